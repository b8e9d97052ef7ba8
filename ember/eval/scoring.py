"""Log-likelihoods of continuations and of whole texts, batched: what every eval task is built from.

`loglikelihood` follows lm-evaluation-harness's definition (HFLM._encode_pair and _loglikelihood_tokens), so
numbers compare with the harness: the context's trailing spaces move to the continuation, the continuation's
tokens are those of encode(context + continuation) after encode(context), the input is cut to the model's
context from the left, and `greedy` says whether argmax decoding would have produced every continuation token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import DataError


@dataclass(frozen=True)
class Score:
    logprob: float  # sum of the continuation tokens' log-probabilities (natural log)
    greedy: bool  # every continuation token is the argmax at its position
    n_tokens: int


@contextlib.contextmanager
def _scoring(model: nn.Module) -> Iterator[None]:
    """Eval mode and whole (unchunked) logits for the duration; the model's own settings after."""
    was_training, chunks = model.training, getattr(model, "output_chunks", 1)
    model.eval()
    model.output_chunks = 1
    try:
        yield
    finally:
        model.output_chunks = chunks
        model.train(was_training)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's HFLM splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def score_tokens(model: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 16) -> list[Score]:
    """Score each (context ids, continuation ids): longest first in batches (right padding cannot change a
    causal model's earlier positions), the input cut to max_seq_len tokens from the left."""
    device = next(model.parameters()).device
    limit = model.args.max_seq_len
    inputs = []
    for context, continuation in pairs:
        if not continuation:
            raise DataError("a continuation encodes to no tokens (an empty answer or choice in the task data)")
        whole = (context + continuation)[-(limit + 1):][:-1]  # the last continuation token is only a target
        inputs.append((whole, continuation))
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
    scores: list[Score] = [None] * len(inputs)  # type: ignore[list-item]
    with _scoring(model):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = len(inputs[batch[0]][0])
            tokens = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids = inputs[i][0]
                tokens[row, :len(ids)] = torch.tensor(ids)
            logits = model(tokens.to(device)).float()  # (B, T, V)
            for row, i in enumerate(batch):
                ids, continuation = inputs[i]
                n = len(continuation)
                logprobs = F.log_softmax(logits[row, len(ids) - n:len(ids)], dim=-1)  # (n, V)
                target = torch.tensor(continuation, device=device)
                picked = logprobs.gather(1, target[:, None]).squeeze(1)
                scores[i] = Score(float(picked.sum()), bool((logprobs.argmax(-1) == target).all()), n)
    return scores


def loglikelihood(model: nn.Module, tokenizer: Any, requests: Sequence[tuple[str, str]],
                  batch_size: int = 16) -> list[Score]:
    """Score each (context, continuation) text pair (lm-eval's `loglikelihood`)."""
    return score_tokens(model, [encode_pair(tokenizer, c, x) for c, x in requests], batch_size)


@torch.no_grad()
def rolling_logprob(model: nn.Module, ids: list[int], window: int, stride: int, batch_size: int = 8) -> tuple[float, int]:
    """(summed log-probability, tokens scored) of every token of `ids` after the first, each predicted once
    with up to `window` tokens of context: windows start every `stride` tokens and each scores only the tokens
    the previous one did not (the sliding-window perplexity of lm-eval's loglikelihood_rolling and of HF's
    perplexity guide)."""
    device = next(model.parameters()).device
    # A window is the input ids[start:last] predicting ids[start + 1 .. last]; it scores the targets after the
    # previous window's (stride <= window, so every target keeps at least window - stride tokens of context).
    spans = []  # (start, last, first target)
    scored = 0  # the last target index scored so far
    for start in range(0, len(ids) - 1, stride):
        last = min(start + window, len(ids) - 1)
        if last > scored:
            spans.append((start, last, scored + 1))
            scored = last
    total, count = 0.0, 0
    with _scoring(model):
        for i in range(0, len(spans), batch_size):
            group = spans[i:i + batch_size]
            width = max(last - start for start, last, _ in group)
            tokens = torch.zeros(len(group), width, dtype=torch.long)
            for row, (start, last, _) in enumerate(group):
                tokens[row, :last - start] = torch.tensor(ids[start:last])
            logits = model(tokens.to(device)).float()  # (B, width, V): position p predicts ids[start + p + 1]
            for row, (start, last, first) in enumerate(group):
                target = torch.tensor(ids[first:last + 1], device=device)
                logprobs = F.log_softmax(logits[row, first - start - 1:last - start], dim=-1)
                total += float(logprobs.gather(1, target[:, None]).sum())
                count += len(target)
    return total, count
