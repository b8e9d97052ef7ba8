"""The eval tasks of `ember eval`, each a function (model, tokenizer, data, options) -> metrics dict.

- ppl: token loss, perplexity and bits per byte of an ember data source (its validation or training split, or
  all of it), over a sliding window (`eval.seq_len`, `eval.stride`).
- lambada: last-word prediction (lambada_openai's jsonl of {"text"}): acc = greedy continuation equals the
  whole target word, perplexity = exp(-mean log-likelihood of the target) (lm-eval's definitions).
- boolq: {"passage", "question", "answer"}: " yes" vs " no" after lm-eval's prompt; acc.
- choice: {"context", "choices", "label"}: acc and acc_norm (log-likelihood per character of the choice).
Local jsonl files always; a hub name (lambada_openai, boolq) through `datasets` where the network allows.
Every row is checked when it is read (types, boolq's answer, choice's label): a bad one is a DataError naming
its file and line, before any forward.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from ember.config_schema import DataConfig, EvalTask, JobConfig
from ember.data.hub import load_hub_table
from ember.data.jsonl import read_json_rows
from ember.errors import ConfigError, DataError, UserFileNotFound
from ember.eval.distributed import EvalRanks
from ember.eval.scoring import loglikelihood, rolling_logprob

if TYPE_CHECKING:
    from ember.data.tokenizer import AnyTokenizer

HUB = {"lambada": ("EleutherAI/lambada_openai", "default", "test"), "boolq": ("super_glue", "boolq", "validation")}
PPL_SPLITS = ("val", "train", "all")  # eval.split: ember's held-out share, the rest, or every document

# A field's parser: the value as read from JSON -> the value the task uses; ValueError("must be ...") otherwise.
Parse = Callable[[Any], Any]
BOOLQ_ANSWERS = {"true": True, "yes": True, "false": False, "no": False}


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _lambada_text(value: Any) -> str:
    if not isinstance(value, str) or " " not in value.strip():
        raise ValueError("must be a string of a context and a last word (the target)")
    return value


def boolq_answer(value: Any) -> bool:
    """A JSON boolean (the dataset's own files), or the strings true/false/yes/no in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in BOOLQ_ANSWERS:
        return BOOLQ_ANSWERS[value.lower()]
    raise ValueError('must be true or false (a JSON boolean, or "true", "false", "yes", "no")')


# choice scores context + " " + choice: lm-eval's target_delimiter, which its multiple-choice tasks put between the
# two. Whitespace the data adds beside it would be scored as a second space, so it is refused, not guessed at.
DELIMITER_NOTE = "one space is put between context and choice, as lm-eval's target_delimiter does"


def _choice_context(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if value.endswith((" ", "\t")):
        raise ValueError(f"must not end with a space or tab ({DELIMITER_NOTE})")
    return value


def _choices(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ValueError("must be a non-empty list of strings")
    if any(c[:1].isspace() for c in value):
        raise ValueError(f"must be written without leading whitespace ({DELIMITER_NOTE})")
    return value


def _label(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer index into choices")
    return value


def _label_in_range(row: dict) -> Optional[str]:
    if not 0 <= row["label"] < len(row["choices"]):
        return f"'label' {row['label']} is not an index into its {len(row['choices'])} choices"
    return None


def check_limit(limit: Optional[int], name: str = "eval.limit") -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"{name} must be an integer >= 1 (leave it unset to score every row), got {limit!r}")


def read_rows(spec: str, task: str, fields: tuple[str, ...], limit: Optional[int] = None,
              parse: Optional[dict[str, Parse]] = None, check: Optional[Callable[[dict], Optional[str]]] = None
              ) -> list[dict]:
    """The rows of a local jsonl file (or of the task's hub dataset when `spec` is not a path), each checked
    for `fields`, each field in `parse` replaced by its parsed value and each row passed to `check` (a problem
    or None); errors name the file and line. The first `limit` rows (>= 1; None: all) are returned."""
    check_limit(limit)
    if "://" in spec:  # a file on a store: its local copy (ember/storage/cache.py)
        from ember.storage.cache import local_copy
        from ember.storage.location import check_source_url

        check_source_url(spec, f"{task} data")
        spec = str(local_copy(spec, f"{task} data"))
    path = Path(spec).expanduser()
    if path.is_file():
        located = read_json_rows(path, f"{task} data")
        for where, row in located:
            missing = [f for f in fields if f not in row]
            if missing:
                raise DataError(f"{where} has no '{missing[0]}' field ({task} rows need {', '.join(fields)})")
    elif spec in (task, HUB.get(task, ("",))[0]) and task in HUB:
        name, config, split = HUB[task]
        rows = [dict(r) for r in load_hub_table(name, config, split, f"{task} data",
                                                f"; give a local jsonl file ({task}=FILE.jsonl)")]
        if task == "boolq":  # super_glue's fields: passage, question, label (0 = False, 1 = True; others refused)
            rows = [{"passage": r["passage"], "question": r["question"],
                     "answer": {0: False, 1: True}.get(r["label"], r["label"])} for r in rows]
        located = [(f"{name} ({split}) row {i}", row) for i, row in enumerate(rows, 1)]
    else:
        raise UserFileNotFound(f"{task} data '{spec}' does not exist; give a local jsonl file"
                               + (f" or '{task}' for the hub" if task in HUB else ""))
    if not located:
        raise DataError(f"{task} data '{spec}' is empty")
    rows = []
    for where, row in located:
        for field, parser in (parse or {}).items():
            try:
                row[field] = parser(row[field])
            except ValueError as err:
                raise DataError(f"{where}: '{field}' {err}, got {json.dumps(row[field])}") from None
        problem = check(row) if check else None
        if problem:
            raise DataError(f"{where}: {problem}")
        rows.append(row)
    return rows if limit is None else rows[:limit]


def lambada_rows(spec: str, limit: Optional[int] = None) -> list[dict]:
    return read_rows(spec, "lambada", ("text",), limit, {"text": _lambada_text})


def boolq_rows(spec: str, limit: Optional[int] = None) -> list[dict]:
    return read_rows(spec, "boolq", ("passage", "question", "answer"), limit,
                     {"passage": _string, "question": _string, "answer": boolq_answer})


def choice_rows(spec: str, limit: Optional[int] = None) -> list[dict]:
    return read_rows(spec, "choice", ("context", "choices", "label"), limit,
                     {"context": _choice_context, "choices": _choices, "label": _label}, _label_in_range)


def lambada(model: nn.Module, tokenizer: AnyTokenizer, spec: str, limit: Optional[int] = None, batch_size: int = 16,
            ranks: EvalRanks = EvalRanks()) -> dict:
    rows = lambada_rows(spec, limit)
    requests = []
    for row in rows:
        context, _, word = row["text"].strip().rpartition(" ")  # lm-eval: the target is " " + the last word
        requests.append((context, " " + word))
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    return {"acc": sum(s.greedy for s in scores) / len(scores),
            "perplexity": math.exp(-sum(s.logprob for s in scores) / len(scores)), "n": len(scores)}


def boolq(model: nn.Module, tokenizer: AnyTokenizer, spec: str, limit: Optional[int] = None, batch_size: int = 16,
          ranks: EvalRanks = EvalRanks()) -> dict:
    rows = boolq_rows(spec, limit)
    requests = []
    for row in rows:
        prompt = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
        requests += [(prompt, " no"), (prompt, " yes")]
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    correct = sum((scores[2 * i + 1].logprob > scores[2 * i].logprob) == row["answer"] for i, row in enumerate(rows))
    return {"acc": correct / len(rows), "n": len(rows)}


def choice(model: nn.Module, tokenizer: AnyTokenizer, spec: str, limit: Optional[int] = None, batch_size: int = 16,
           ranks: EvalRanks = EvalRanks()) -> dict:
    rows = choice_rows(spec, limit)
    requests = [(row["context"], " " + text) for row in rows for text in row["choices"]]
    scores = loglikelihood(model, tokenizer, requests, batch_size, ranks)
    acc = acc_norm = 0
    offset = 0
    for row in rows:
        n = len(row["choices"])
        mine = scores[offset:offset + n]
        lengths = [len(" " + t) for t in row["choices"]]  # lm-eval's acc_norm: per character
        acc += max(range(n), key=lambda j: mine[j].logprob) == row["label"]
        acc_norm += max(range(n), key=lambda j: mine[j].logprob / lengths[j]) == row["label"]
        offset += n
    return {"acc": acc / len(rows), "acc_norm": acc_norm / len(rows), "n": len(rows)}


def ppl(model: nn.Module, tokenizer: AnyTokenizer, data_cfg: DataConfig, split: str = "val",
        seq_len: Optional[int] = None, stride: Optional[int] = None, max_tokens: Optional[int] = None,
        batch_size: int = 8, ranks: EvalRanks = EvalRanks()) -> dict:
    """Loss per token, perplexity and bits per byte of `split` of an ember data source ("val": the share
    data.val_fraction holds out, "train": the rest, "all": every document): documents joined with EOS as in
    training, scored by a sliding window of `seq_len` tokens (default: the model's max_seq_len) every `stride`
    (default: half a window), both returned with the numbers. Bits per byte divide the total negative
    log-likelihood (in bits) by the UTF-8 bytes of the text scored, so models with different tokenizers compare."""
    from ember.data.sources import load_documents

    if split not in PPL_SPLITS:
        raise ConfigError(f"eval.split must be one of {', '.join(PPL_SPLITS)}, got '{split}'")
    if split == "val" and data_cfg.val_fraction == 0:
        raise ConfigError(f"data.val_fraction=0 holds out no validation split of '{data_cfg.dataset}'; "
                          "score all of it with eval.split=all")
    from ember.storage.cache import local_data

    data_cfg = local_data(data_cfg)  # a source given as a URL: its local copy
    # "all": no document held out, so ember's train split is every document, in the source's order
    docs = (load_documents(dataclasses.replace(data_cfg, val_fraction=0.0), "train") if split == "all"
            else load_documents(data_cfg, split))
    window = seq_len or model.args.max_seq_len
    stride = stride or window // 2
    if window > model.args.max_seq_len:
        raise ConfigError(f"eval.seq_len={window} exceeds the model's max_seq_len={model.args.max_seq_len}; "
                          f"set eval.seq_len={model.args.max_seq_len} or less")
    if not 0 < stride <= window:
        raise ConfigError(f"eval.stride={stride} must be in [1, eval.seq_len={window}]")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"eval.max_tokens must be >= 1 (leave it unset to score every token), got {max_tokens}")
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
    # the window and stride go with the numbers: the same weights score differently under another window
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": -logprob / math.log(2) / max(n_bytes, 1),
            "tokens": count, "seq_len": window, "stride": stride}


TASKS: dict[str, Callable[..., dict]] = {"lambada": lambada, "boolq": boolq, "choice": choice}
TASK_ROWS: dict[str, Callable[..., list[dict]]] = {"lambada": lambada_rows, "boolq": boolq_rows,
                                                    "choice": choice_rows}


def run_tasks(model: nn.Module, tokenizer: AnyTokenizer, tasks: list[EvalTask], limit: Optional[int] = None,
              batch_size: int = 16, ranks: EvalRanks = EvalRanks()) -> dict[str, float]:
    """Several tasks ({name, data} each, as eval.tasks holds them) as one flat record: eval/<task>/<metric>."""
    results: dict[str, float] = {}
    for task in tasks:
        metrics = TASKS[task.name](model, tokenizer, task.data, limit, batch_size, ranks)
        results.update({f"eval/{task.name}/{k}": v for k, v in metrics.items()})
    return results


def check(cfg: JobConfig) -> None:
    """In-loop eval tasks (eval.tasks): known names, and data that exists with every row's fields and types,
    before training starts (ember.train.run.load_config calls this)."""
    first: dict[str, int] = {}
    for i, task in enumerate(cfg.eval.tasks):
        if task.name not in TASKS:
            raise ConfigError(f"eval.tasks[{i}].name '{task.name}' is not one of {', '.join(TASKS)}")
        if task.name in first:  # the records hold one eval/<task>/<metric> per name
            raise ConfigError(f"eval.tasks[{i}] is a second {task.name} task (eval.tasks[{first[task.name]}] is one): "
                              f"its eval/{task.name}/* results would overwrite the first's; keep one {task.name} task "
                              f"in training and score other data with `ember eval RUN {task.name}=FILE`")
        first[task.name] = i
        if "://" in task.data:  # on a store: there (named by its key), then read from its local copy
            from ember.storage.location import check_source_url

            check_source_url(task.data, f"eval.tasks[{i}].data")
        if "://" in task.data or Path(task.data).expanduser().is_file():
            TASK_ROWS[task.name](task.data)  # every row's fields and types, before training starts
        elif not (task.name in HUB and task.data in (task.name, HUB[task.name][0])):
            raise ConfigError(f"eval.tasks[{i}].data '{task.data}' is not a file; give a local jsonl"
                              + (f" or '{task.name}' for the hub" if task.name in HUB else ""))
    if cfg.eval.tasks and cfg.data.dataset == "synthetic" and cfg.data.tokenizer is None:
        raise ConfigError("eval.tasks need a tokenizer, and data.dataset=synthetic has none; set data.tokenizer")
