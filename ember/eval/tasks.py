"""The eval tasks of `ember eval`, each a function (model, tokenizer, data, options) -> metrics dict.

- ppl: token loss, perplexity and bits per byte of an ember data source (validation split by default),
  over a sliding window (`eval.seq_len`, `eval.stride`).
- lambada: last-word prediction (lambada_openai's jsonl of {"text"}): acc = greedy continuation equals the
  whole target word, perplexity = exp(-mean log-likelihood of the target) (lm-eval's definitions).
- boolq: {"passage", "question", "answer"}: " yes" vs " no" after lm-eval's prompt; acc.
- choice: {"context", "choices", "label"}: acc and acc_norm (log-likelihood per character of the choice).
Local jsonl files always; a hub name (lambada_openai, boolq) through `datasets` where the network allows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from ember.errors import ConfigError, DataError, UserFileNotFound
from ember.eval.distributed import EvalRanks
from ember.eval.scoring import loglikelihood, rolling_logprob

HUB = {"lambada": ("EleutherAI/lambada_openai", "default", "test"), "boolq": ("super_glue", "boolq", "validation")}


def read_rows(spec: str, task: str, fields: tuple[str, ...], limit: Optional[int] = None) -> list[dict]:
    """The rows of a local jsonl file (or of the task's hub dataset when `spec` is not a path), each checked
    for `fields`; errors name the file, line and field."""
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise DataError(f"{task} data '{path}' is not UTF-8 text") from None
        rows = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise DataError(f"{path} line {lineno} is not valid JSON") from None
            missing = [f for f in fields if not isinstance(row, dict) or f not in row]
            if missing:
                raise DataError(f"{path} line {lineno} has no '{missing[0]}' field ({task} rows need "
                                f"{', '.join(fields)})")
            rows.append(row)
    elif spec in (task, HUB.get(task, ("",))[0]) and task in HUB:
        from ember.data.sources import _import_datasets

        name, config, split = HUB[task]
        datasets = _import_datasets(f"{task} from the hub ({name})")
        rows = [dict(r) for r in datasets.load_dataset(name, config, split=split)]
        if task == "boolq":  # super_glue's fields: passage, question, label (0 = False)
            rows = [{"passage": r["passage"], "question": r["question"], "answer": bool(r["label"])} for r in rows]
    else:
        raise UserFileNotFound(f"{task} data '{spec}' does not exist; give a local jsonl file"
                               + (f" or '{task}' for the hub" if task in HUB else ""))
    if not rows:
        raise DataError(f"{task} data '{spec}' is empty")
    return rows[:limit] if limit else rows


def lambada(model: nn.Module, tokenizer: Any, spec: str, limit: Optional[int] = None, batch_size: int = 16,
            ranks: EvalRanks = EvalRanks()) -> dict:
    rows = read_rows(spec, "lambada", ("text",), limit)
    requests = []
    for row in rows:
        context, _, word = row["text"].strip().rpartition(" ")  # lm-eval: the target is " " + the last word
        requests.append((context, " " + word))
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    return {"acc": sum(s.greedy for s in scores) / len(scores),
            "perplexity": math.exp(-sum(s.logprob for s in scores) / len(scores)), "n": len(scores)}


def boolq(model: nn.Module, tokenizer: Any, spec: str, limit: Optional[int] = None, batch_size: int = 16,
          ranks: EvalRanks = EvalRanks()) -> dict:
    rows = read_rows(spec, "boolq", ("passage", "question", "answer"), limit)
    requests = []
    for row in rows:
        prompt = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
        requests += [(prompt, " no"), (prompt, " yes")]
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    correct = sum((scores[2 * i + 1].logprob > scores[2 * i].logprob) == bool(row["answer"])
                  for i, row in enumerate(rows))
    return {"acc": correct / len(rows), "n": len(rows)}


def choice(model: nn.Module, tokenizer: Any, spec: str, limit: Optional[int] = None, batch_size: int = 16,
           ranks: EvalRanks = EvalRanks()) -> dict:
    rows = read_rows(spec, "choice", ("context", "choices", "label"), limit)
    requests, owners = [], []
    for i, row in enumerate(rows):
        if not isinstance(row["choices"], list) or not row["choices"] or not 0 <= int(row["label"]) < len(row["choices"]):
            raise DataError(f"choice data '{spec}' row {i + 1}: choices must be a non-empty list and label an index "
                            "into it")
        for text in row["choices"]:
            requests.append((row["context"], " " + str(text)))
            owners.append(i)
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    acc = acc_norm = 0
    offset = 0
    for row in rows:
        n = len(row["choices"])
        mine = scores[offset:offset + n]
        lengths = [len(" " + str(t)) for t in row["choices"]]  # lm-eval's acc_norm: per character
        acc += max(range(n), key=lambda j: mine[j].logprob) == int(row["label"])
        acc_norm += max(range(n), key=lambda j: mine[j].logprob / lengths[j]) == int(row["label"])
        offset += n
    return {"acc": acc / len(rows), "acc_norm": acc_norm / len(rows), "n": len(rows)}


def ppl(model: nn.Module, tokenizer: Any, data_cfg: Any, split: str = "val", seq_len: Optional[int] = None,
        stride: Optional[int] = None, max_tokens: Optional[int] = None, batch_size: int = 8,
        ranks: EvalRanks = EvalRanks()) -> dict:
    """Loss per token, perplexity and bits per byte of `split` of an ember data source: documents joined with
    EOS as in training, scored by a sliding window. Bits per byte divide the total negative log-likelihood (in
    bits) by the UTF-8 bytes of the text scored, so models with different tokenizers compare."""
    from ember.data.sources import load_documents

    docs = load_documents(data_cfg, split)
    window = seq_len or model.args.max_seq_len
    stride = stride or window // 2
    if window > model.args.max_seq_len:
        raise ConfigError(f"eval.seq_len={window} exceeds the model's max_seq_len={model.args.max_seq_len}; "
                          f"set eval.seq_len={model.args.max_seq_len} or less")
    if not 0 < stride <= window:
        raise DataError(f"eval stride={stride} must be in (0, seq_len={window}]")
    ids: list[int] = []
    for text in docs.texts:
        ids += tokenizer.encode(text[1] if isinstance(text, tuple) else text) + [tokenizer.eos_id]  # SFT: response
        if max_tokens and len(ids) > max_tokens:
            break
    ids = ids[:max_tokens + 1] if max_tokens else ids
    if len(ids) < 2:
        raise DataError(f"{docs.name} ({split} split) has no text to score")
    logprob, count = rolling_logprob(model, ids, window, stride, batch_size, ranks)
    loss = -logprob / count
    n_bytes = len(tokenizer.decode(ids[1:], skip_special_tokens=True).encode("utf-8"))  # the text scored
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": -logprob / math.log(2) / max(n_bytes, 1),
            "tokens": count}


TASKS: dict[str, Callable[..., dict]] = {"lambada": lambada, "boolq": boolq, "choice": choice}


def run_tasks(model: nn.Module, tokenizer: Any, tasks: list[Any], limit: Optional[int] = None,
              batch_size: int = 16, ranks: EvalRanks = EvalRanks()) -> dict[str, float]:
    """Several tasks ({name, data} each, as eval.tasks holds them) as one flat record: eval/<task>/<metric>."""
    results: dict[str, float] = {}
    for task in tasks:
        metrics = TASKS[task.name](model, tokenizer, task.data, limit, batch_size, ranks)
        results.update({f"eval/{task.name}/{k}": v for k, v in metrics.items()})
    return results
