"""GRPO's rollouts: `group_size` completions of each prompt sampled from the policy itself with ember's KV-cache
generation (ember/generate.py), and the rows the policy loss is computed on.

A completion keeps the EOS that ended it (the policy learns to stop); one cut by max_new_tokens is `truncated`
and, with mask_truncated, takes no part in the loss (DAPO's overlong filtering). The training rows put each
prompt and its completion from position 0, right-padded: row i's completion token j sits at P_i + j and is
predicted by the logits at P_i + j - 1, which is where `targets` holds it and `mask` is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from ember.data.tokenizer import AnyTokenizer
from ember.generate import generate


@dataclass
class Rollouts:
    """N = prompts x group_size completions, each prompt's group_size rows consecutive."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # with the EOS that ended it, if one did
    texts: list[str]  # the completions' text (without EOS or the stop string)
    truncated: list[bool]  # cut by max_new_tokens


def sample(model: nn.Module, tokenizer: AnyTokenizer, prompts: Sequence[Sequence[int]], group_size: int, *,
           max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
           stop: Sequence[str] = (), seed: Optional[int] = None, sharded: bool = False,
           cache_dtype: Optional[torch.dtype] = None, compile: bool = False,
           cache_len: Optional[int] = None) -> Rollouts:
    """group_size completions of each prompt (token ids), sampled in one batch; `seed` makes them reproducible.
    sharded: the model's forward is a collective of every rank (FSDP), so each rank decodes until all are done.
    cache_dtype: the KV cache's (the compute dtype under autocast); compile, cache_len: generate()'s."""
    rows = [list(p) for p in prompts for _ in range(group_size)]
    generations = generate(model, tokenizer, rows, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                           all_done=every_rank_done if sharded else None, cache_dtype=cache_dtype,
                           compile=compile, cache_len=cache_len)
    eos = getattr(tokenizer, "eos_id", None)
    completions = [g.token_ids + ([eos] if g.stop_reason == "eos" and eos is not None else []) for g in generations]
    return Rollouts(rows, completions, [g.completion for g in generations],
                    [g.stop_reason == "length" for g in generations])


def every_rank_done(done: bool) -> bool:
    """Whether every rank of the default process group is done (an all-reduce of one flag)."""
    import torch.distributed as dist

    flag = torch.tensor([int(done)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def training_rows(rollouts: Rollouts, mask_truncated: bool = False,
                  pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask), each (N, L): prompt + completion from position 0, right-padded; targets[i, t] the
    token at t + 1 where it is a completion token (mask 1), else pad_id (mask 0)."""
    length = max(len(p) + len(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids))
    n = len(rollouts.prompt_ids)
    inputs = torch.full((n, length), pad_id, dtype=torch.long)
    targets = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids)):
        row = prompt + completion
        inputs[i, :len(row)] = torch.tensor(row)
        if not completion:
            continue
        start = len(prompt) - 1  # the logits that predict the first completion token
        targets[i, start:start + len(completion)] = torch.tensor(completion)
        if not (mask_truncated and rollouts.truncated[i]):
            mask[i, start:start + len(completion)] = 1
    return inputs, targets, mask
