"""Norms beside the Llama RMSNorm (nn/decoder.py).

OffsetRMSNorm: RMSNorm with a (1 + w) gain (Gemma's): the weight is stored as an offset from one, starts at zero, and
the scaling runs in fp32 before the cast back (Gemma multiplies in fp32; Llama's RMSNorm casts, then multiplies).
WeightlessRMSNorm: no gain at all (Llama 4's q/k norm)."""

from __future__ import annotations

import torch
from torch import nn


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # a gain of one


class WeightlessRMSNorm(nn.Module):
    """RMS normalisation with no gain, in fp32 (Llama 4's q/k "L2 norm": x / sqrt(mean(x^2) + eps))."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def reset_parameters(self) -> None:  # nothing to fill; norms share this method
        pass
