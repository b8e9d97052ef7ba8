"""The gated feed-forward most families share: w2(act(w1 x) * w3 x), SwiGLU with silu (Llama, Mistral, Qwen),
GeGLU with tanh-approximated GELU (Gemma). Parameter names are Meta's (w1 gate, w3 up, w2 down), which the
tensor-parallel plans and LoRA's target names use."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x) (Shazeer 2020): (B, T, dim) -> (B, T, dim) through a hidden width of hidden_dim."""

    def __init__(self, dim: int, hidden_dim: int, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))  # (B, T, hidden) -> (B, T, dim)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)
