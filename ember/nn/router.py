"""The MoE router: each token's top-k experts and their weights, with the families' variants (softmax or sigmoid
scores, DeepSeek's group-limited choice and score bias)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Linear scores over experts, and each token's top-k of them with their weights.

    score_func="softmax" (Mixtral, Qwen3-MoE, DeepSeek-V2): probabilities over all experts; norm_topk_prob renormalises
    the chosen k to sum to 1 (the same as Mixtral's softmax over the selected logits), without it they stay as they are.
    score_func="sigmoid" (DeepSeek-V3, Llama 4): an independent score per expert; norm_topk_prob divides the chosen k
    by their sum (DeepSeek-V3), without it they stay as they are (Llama 4's top-1).
    score_bias: DeepSeek-V3's aux-loss-free balancing, a per-expert bias added to the scores only to choose experts
    (not to weigh them), moved against each expert's load after every step (`update_score_bias`).
    n_groups > 1: group-limited routing, experts chosen only from the topk_groups groups that score best: by the sum
    of each group's two best sigmoid scores (DeepSeek-V3) or its best softmax probability (DeepSeek-V2).
    route_scale multiplies the final weights (DeepSeek's routed_scaling_factor)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = True, *,
                 score_func: str = "softmax", n_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 score_bias: bool = False):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"Router score_func must be 'softmax' or 'sigmoid', not {score_func!r}")
        if n_experts % n_groups or not 1 <= topk_groups <= n_groups or top_k > topk_groups * (n_experts // n_groups):
            raise ValueError(f"{n_experts} experts do not split into {n_groups} groups of which {topk_groups} hold "
                             f"the top {top_k}")
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.score_func, self.n_groups, self.topk_groups, self.route_scale = (score_func, n_groups, topk_groups,
                                                                              route_scale)
        self.gate = nn.Linear(dim, n_experts, bias=False)
        # A persistent buffer, not a parameter: the optimizer never sees it; checkpoints and HF exports carry it.
        self.score_bias: Optional[torch.Tensor]
        self.register_buffer("score_bias", torch.zeros(n_experts, dtype=torch.float32) if score_bias else None)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router logits (N, E) -> fp32 scores (N, E), as the reference routes in fp32."""
        return F.softmax(logits.float(), dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> weights (N, k), expert indices (N, k), router logits (N, E)."""
        return self.route(x)[:3]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward's three, and the fp32 scores (N, E) they came from (the MoE layer's balance loss reads them)."""
        logits = self.gate(x)
        scores = self.scores(logits)
        choice = scores if self.score_bias is None else scores + self.score_bias
        if self.n_groups > 1:
            grouped = choice.unflatten(-1, (self.n_groups, -1))  # (N, groups, experts per group)
            group_score = (grouped.topk(2, dim=-1).values.sum(-1) if self.score_func == "sigmoid"
                           else grouped.amax(dim=-1))  # (N, groups)
            kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            choice = choice.masked_fill(~kept[..., None].expand_as(grouped).flatten(1), float("-inf"))
        indices = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            # DeepSeek-V3 guards its sum of sigmoids against zero; a softmax's top-k sum is never zero
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return weights.to(x.dtype), indices, logits, scores

    def balance_probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """route's scores (N, E) -> each token's distribution over experts for the load-balancing loss: the softmax,
        or the sigmoid scores normalised to sum to 1 (DeepSeek-V3's sequence-wise balance loss)."""
        return scores if self.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
