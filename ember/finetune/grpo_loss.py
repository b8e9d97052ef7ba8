"""Group Relative Policy Optimization's objective (Shao et al. 2024, arXiv:2402.03300) and its variants: the
advantages of a group's completions and the clipped-ratio policy loss, as pure functions of tensors.

The variants differ in how rewards become advantages and how per-token losses are averaged (the conventions of
TRL's GRPOTrainer, which tests/finetune/test_grpo_loss.py checks this against):
- advantages: `(r - mean(group)) / (std(group) + eps)` (scale="group", GRPO), the batch's std instead
  (scale="batch"), or `r - mean(group)` alone (scale="none", Dr. GRPO). std is the unbiased one;
- loss_type "grpo": each completion's mean token loss, averaged over completions (short completions weigh more
  per token); "bnpo": the mean over the batch's completion tokens; "dr_grpo": the sum over tokens divided by
  completions x max_completion_length (no length bias); "dapo": the sum divided by the completion tokens of the
  whole rollout batch, over every rank and micro-batch (`token_count`), so that the loss is one token-level mean
  whatever the layout;
- the ratio pi/pi_old is clipped to [1 - clip_low, 1 + clip_high] (DAPO's asymmetric clip when they differ);
- beta > 0 adds beta x KL(pi || pi_ref) per token with the k3 estimator exp(q) - q - 1, q = log pi_ref - log pi,
  multiplied by the ratio pi/pi_old (kl_ratio_correction, the default, as TRL's: the ratio, differentiable, makes
  the KL's gradient the unbiased reverse-KL gradient for samples drawn from pi_old; DeepSeek-V3.2).
"""

from __future__ import annotations

from typing import Optional

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ADVANTAGE_SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std: a group of equal rewards gets advantage 0, not 0/0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """(N,) rewards of N / group_size prompts' consecutive groups of completions -> (N,) advantages."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale={scale!r}: choose one of {', '.join(ADVANTAGE_SCALES)}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) if group_size > 1 else 0 * advantages
    elif scale == "batch":
        std = rewards.float().std().expand_as(advantages) if rewards.numel() > 1 else 0 * advantages
    else:
        return advantages
    return advantages / (std + STD_EPS)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each token under (B, T, V) logits (the logits that predict it), in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, loss_type: str = "grpo", clip_low: float = 0.2, clip_high: float = 0.2, beta: float = 0.0,
                ref_logprobs: Optional[torch.Tensor] = None, kl_ratio_correction: bool = True,
                max_completion_length: Optional[int] = None, token_count: Optional[torch.Tensor] = None,
                rows_total: Optional[int] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of B completions' tokens ((B, T) log-probs under the policy being trained, under the policy that
    sampled them, and under the reference when beta > 0; `mask` 1 on the completion tokens that count) and (B,)
    advantages; with the step's statistics (detached): the fraction of tokens clipped low and high and the mean KL.

    For a micro-batch of a larger rollout batch, give the whole batch's completions (`rows_total`) and counted
    tokens (`token_count`): the micro-batches' losses (over every rank) then sum to the whole batch's, gradients
    included. Without them the normalizers are this batch's own (dapo always needs token_count)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    advantages = advantages.to(logprobs.dtype).unsqueeze(1)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    stats = {}
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference's log-probs")
        q = ref_logprobs - logprobs
        kl = torch.exp(q) - q - 1
        stats["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
        per_token = per_token + beta * (kl * ratio if kl_ratio_correction else kl)
    tokens = mask.sum().clamp(min=1)
    stats["clipped_low"] = (((ratio < 1 - clip_low) & (advantages < 0)).to(mask.dtype) * mask).sum().detach() / tokens
    stats["clipped_high"] = (((ratio > 1 + clip_high) & (advantages > 0)).to(mask.dtype) * mask).sum().detach() / tokens
    masked = per_token * mask
    rows = rows_total or logprobs.shape[0]
    if loss_type == "grpo":
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows
    elif loss_type == "bnpo":
        loss = masked.sum() / (tokens if token_count is None else token_count.clamp(min=1))
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: give it")
        loss = masked.sum() / (rows * max_completion_length)
    else:
        if token_count is None:
            raise ValueError("loss_type='dapo' divides by the rollout batch's completion tokens: give token_count")
        loss = masked.sum() / token_count.clamp(min=1)
    return loss, stats
