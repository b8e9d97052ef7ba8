"""Rotary position embeddings: a table's typed settings (RopeConfig), its cos/sin tables, and the rotation.

RoPE is Meta's convention (consecutive pairs of each head rotate together); models/*/hf.py map Hugging Face
weights (whose pairs are k and k + head_dim/2) onto it. A family's args say what its tables are
(`DecoderArgs.rope`, `.local_rope`): the base, how many of each head's dims turn, how many positions, and at most
one frequency scaling, each kind a dataclass of its own settings (HF's rope_type names the kind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch

from ember.nn.yarn import YarnScaling, yarn_inv_freq


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling (Meta's `apply_scaling`; Llama 3.1-3.2, Llama 4 Scout)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    kind: ClassVar[str] = "llama3"
    table_scale: ClassVar[Optional[float]] = None


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by `factor` (Gemma 3's global layers, 4B-27B)."""

    factor: float

    kind: ClassVar[str] = "linear"
    table_scale: ClassVar[Optional[float]] = None


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Phi-3's 128K models): one factor per frequency, and q and k both scaled by `attention_factor`
    through the tables (None: unscaled)."""

    factors: tuple[float, ...]
    attention_factor: Optional[float] = None

    kind: ClassVar[str] = "longrope"

    @property
    def table_scale(self) -> Optional[float]:
        return self.attention_factor


RopeScaling = Union[Llama3Scaling, LinearScaling, LongRopeScaling, YarnScaling]


@dataclass(frozen=True)
class RopeConfig:
    """One set of RoPE tables: base `theta`, the first `rotary_dim` dims of each head turned (a partial rotary
    embedding turns fewer than head_dim: Phi-4-mini, DeepSeek's rope part), `max_seq_len` positions, and at most
    one frequency scaling (None: the plain frequencies)."""

    theta: float
    rotary_dim: int
    max_seq_len: int
    scaling: Optional[RopeScaling] = None

    @property
    def kind(self) -> str:
        """HF's rope_type: default, llama3, linear, longrope or yarn."""
        return self.scaling.kind if self.scaling is not None else "default"

    @property
    def table_scale(self) -> Optional[float]:
        """The factor cos and sin are multiplied by (YaRN's and LongRoPE's attention factor); None: 1."""
        return self.scaling.table_scale if self.scaling is not None else None


def llama3_rope(theta: float, head_dim: int, max_seq_len: int, factor: Optional[float], low_freq_factor: float,
                high_freq_factor: float, original_max_seq_len: int) -> RopeConfig:
    """Llama 3's RoPE (Llama 3.1's frequency scaling where `factor` is set), as Llama 3.x and Llama 4 configure it."""
    scaling = None if factor is None else Llama3Scaling(factor, low_freq_factor, high_freq_factor, original_max_seq_len)
    return RopeConfig(theta, head_dim, max_seq_len, scaling)


def rope_cos_sin(rope: RopeConfig, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angle t * w_k for every position t < max_seq_len: two (max_seq_len, rotary_dim // 2)."""
    dim, scaling = rope.rotary_dim, rope.scaling
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if isinstance(scaling, YarnScaling):  # DeepSeek-V2/V3
        inv_freq = yarn_inv_freq(scaling, rope.theta, dim, device)
    elif isinstance(scaling, Llama3Scaling):
        inv_freq = _llama31_scaling(inv_freq, scaling)
    elif isinstance(scaling, LinearScaling):  # position interpolation (HF rope_type "linear")
        inv_freq = inv_freq / scaling.factor
    elif isinstance(scaling, LongRopeScaling):  # one factor per frequency
        inv_freq = inv_freq / torch.tensor(scaling.factors, device=device, dtype=torch.float32)
    positions = torch.arange(rope.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, rotary dims // 2), fp32 even for long contexts
    scale = rope.table_scale or 1.0
    return angles.cos() * scale, angles.sin() * scale


def _llama31_scaling(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    # Llama 3.1 (Meta's `apply_scaling`): wavelengths longer than the pre-training window are slowed by
    # `factor`, those shorter than window / high_freq_factor are kept, and the band between is blended.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2k], x[..., 2k+1]) of x: (B, T, H, D) by the angles of cos, sin: (T, D // 2),
    or (B, T, D // 2) when every sequence has its own positions. Rotated in fp32, like Meta's reference. Tables
    narrower than D // 2 (a partial rotary embedding: Phi-4-mini) turn the first dims and pass the rest."""
    if cos.shape[-1] * 2 < x.shape[-1]:
        turned = 2 * cos.shape[-1]
        return torch.cat([apply_rope(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]  # (1, T, D/2): the same positions for every sequence
    # fp32 tables even where FSDP's mixed precision cast them with the block's inputs to bf16 (CPU has no
    # bf16 complex kernels, and the rotation is meant to run in fp32).
    cos, sin = cos.float()[:, :, None, :], sin.float()[:, :, None, :]  # (1 or B, T, 1, D/2)
    if torch.compiler.is_compiling():
        # Compiled: the pairwise form, which inductor fuses into the neighbouring element-wise ops
        # (complex tensors it leaves to eager kernels, breaking that fusion).
        pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    # Eager: one complex product (x0 + i x1)(cos + i sin), Meta's formulation: the same multiplies and adds,
    # the same numbers, in one kernel instead of six with their temporaries.
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, D/2)
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).to(x.dtype)  # (B, T, H, D)
