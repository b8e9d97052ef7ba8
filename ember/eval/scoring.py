"""Log-likelihoods of continuations and of whole texts, batched: what every eval task is built from.

`loglikelihood` follows lm-evaluation-harness's definition (HFLM._encode_pair and _loglikelihood_tokens), so
numbers compare with the harness: the context's trailing spaces move to the continuation, the continuation's
tokens are those of encode(context + continuation) after encode(context), the input is cut to the model's
context from the left, and `greedy` says whether argmax decoding would have produced every continuation token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ConfigError, DataError
from ember.eval.distributed import EvalRanks

if TYPE_CHECKING:
    from ember.data.tokenizer import AnyTokenizer


@dataclass(frozen=True)
class Score:
    logprob: float  # sum of the continuation tokens' log-probabilities (natural log)
    greedy: bool  # every continuation token is the argmax at its position
    n_tokens: int


@contextlib.contextmanager
def _scoring(model: nn.Module) -> Iterator[None]:
    """Eval mode for the duration; the model's own mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def encode_pair(tokenizer: AnyTokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HFLM splits them. An empty context is the tokenizer's BOS
    where it declares one (tokenizer_config.json's bos_token; a SentencePiece or tiktoken model's own), else its
    EOS, as lm-eval's loglikelihood does (prefix_token_id): the first continuation token needs a position to be
    predicted from. An ember run's embedded BPE declares none, so its models score after EOS, the document
    boundary they were trained on, as lm-eval's hf model does on their HF export."""
    if context == "":
        ids = tokenizer.encode(continuation)
        bos = getattr(tokenizer, "bos_id", None)
        prefix = bos if bos is not None and getattr(tokenizer, "bos_declared", True) else tokenizer.eos_id
        return ([prefix], ids) if not ids or ids[0] != prefix else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def _scored_logprobs(model: nn.Module, tokens: torch.Tensor, ends: list[int], counts: list[int],
                     targets: list[list[int]], ranks: EvalRanks) -> tuple[list[float], list[bool]]:
    """Row r predicts targets[r] (counts[r] tokens) at the positions just before ends[r]: the summed
    log-probability of each row's targets and whether each was the argmax everywhere. Only those positions'
    logits are computed (`logits_at`), right-aligned in K = the longest count: shorter rows repeat a position
    that their mask then ignores. Under tensor parallelism the logits come whole and are picked after."""
    device = tokens.device
    K = max(counts)
    index = torch.stack([torch.arange(end - K, end).clamp(min=0) for end in ends]).to(device)  # (B, K)
    valid = torch.stack([torch.arange(K) >= K - n for n in counts]).to(device)  # (B, K)
    target = torch.zeros(len(ends), K, dtype=torch.long)
    for row, ids in enumerate(targets):
        target[row, K - len(ids):] = torch.tensor(ids)
    target = target.to(device)
    if ranks.tensor > 1:
        logits = model(tokens)  # (B, T, V) whole on every tensor rank
        logits = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
    else:
        logits = model(tokens, logits_at=index)  # (B, K, V)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, target[..., None]).squeeze(-1)  # (B, K)
    hit = (logprobs.argmax(-1) == target) | ~valid
    return (picked * valid).sum(1).tolist(), hit.all(1).tolist()


def model_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: its parameters' device, or the host for a model that holds none (the XLA engine's
    scoring view, whose weights are jax arrays)."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def check_batch_size(batch_size: int, name: str = "eval.batch_size") -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {batch_size!r}")


def _idle_forward(model: nn.Module, device: torch.device, ranks: EvalRanks) -> None:
    """A forward that scores nothing: a rank whose share of batches ran out keeps FSDP/TP collectives in step."""
    model(torch.zeros(1, ranks.width(1), dtype=torch.long, device=device))


@torch.no_grad()
def score_tokens(model: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 16,
                 ranks: EvalRanks = EvalRanks()) -> list[Score]:
    """Score each (context ids, continuation ids): longest first in batches (right padding cannot change a
    causal model's earlier positions), the input cut to max_seq_len tokens from the left. On a mesh the
    batches are shared out over the data-parallel ranks and every rank returns every score."""
    check_batch_size(batch_size)
    device = model_device(model)
    limit = model.args.max_seq_len
    inputs = []
    for context, continuation in pairs:
        if not continuation:
            raise DataError("a continuation encodes to no tokens (an empty answer or choice in the task data)")
        whole = (context + continuation)[-(limit + 1):][:-1]  # the last continuation token is only a target
        inputs.append((whole, continuation))
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    scored: dict[int, Score] = {}
    with _scoring(model):
        for batch in ranks.share(batches):
            if batch is None:
                _idle_forward(model, device, ranks)
                continue
            tokens = torch.zeros(len(batch), ranks.width(len(inputs[batch[0]][0])), dtype=torch.long)
            for row, i in enumerate(batch):
                ids = inputs[i][0]
                tokens[row, :len(ids)] = torch.tensor(ids)
            sums, greedy = _scored_logprobs(model, tokens.to(device), [len(inputs[i][0]) for i in batch],
                                            [len(inputs[i][1]) for i in batch], [inputs[i][1] for i in batch], ranks)
            for row, i in enumerate(batch):
                scored[i] = Score(sums[row], greedy[row], len(inputs[i][1]))
    scored = ranks.gather(scored)
    return [scored[i] for i in range(len(inputs))]


def loglikelihood(model: nn.Module, tokenizer: AnyTokenizer, requests: Sequence[tuple[str, str]],
                  batch_size: int = 16, ranks: EvalRanks = EvalRanks()) -> list[Score]:
    """Score each (context, continuation) text pair (lm-eval's `loglikelihood`)."""
    return score_tokens(model, [encode_pair(tokenizer, c, x) for c, x in requests], batch_size, ranks)


@torch.no_grad()
def rolling_logprob(model: nn.Module, ids: list[int], window: int, stride: int, batch_size: int = 8,
                    ranks: EvalRanks = EvalRanks()) -> tuple[float, int]:
    """(summed log-probability, tokens scored) of every token of `ids` after the first, each predicted once
    with up to `window` tokens of context: windows start every `stride` tokens and each scores only the tokens
    the previous one did not (the sliding-window perplexity of lm-eval's loglikelihood_rolling and of HF's
    perplexity guide). On a mesh the windows are shared out over the data-parallel ranks."""
    check_batch_size(batch_size)
    device = model_device(model)
    # A window is the input ids[start:last] predicting ids[start + 1 .. last]; it scores the targets after the
    # previous window's (stride <= window, so every target keeps at least window - stride tokens of context).
    spans = []  # (start, last, first target)
    scored = 0  # the last target index scored so far
    for start in range(0, len(ids) - 1, stride):
        last = min(start + window, len(ids) - 1)
        if last > scored:
            spans.append((start, last, scored + 1))
            scored = last
    batches = [list(range(i, min(i + batch_size, len(spans)))) for i in range(0, len(spans), batch_size)]
    results: dict[int, float] = {}
    with _scoring(model):
        for batch in ranks.share(batches):
            if batch is None:
                _idle_forward(model, device, ranks)
                continue
            group = [spans[i] for i in batch]
            tokens = torch.zeros(len(group), ranks.width(max(last - start for start, last, _ in group)),
                                 dtype=torch.long)
            for row, (start, last, _) in enumerate(group):
                tokens[row, :last - start] = torch.tensor(ids[start:last])
            # position p of a row predicts ids[start + p + 1]: the targets ids[first..last] end at position last - start
            sums, _ = _scored_logprobs(model, tokens.to(device), [last - start for start, last, _ in group],
                                       [last - first + 1 for _, last, first in group],
                                       [ids[first:last + 1] for _, last, first in group], ranks)
            results.update(zip(batch, sums))
    results = ranks.gather(results)
    total = sum(results[i] for i in range(len(spans)))  # in window order: the same sum on any mesh
    return total, sum(last - first + 1 for _, last, first in spans)
