"""YaRN RoPE scaling (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2/V3 use it: the frequencies, the tables'
attention factor and the softmax scale's mscale, computed exactly as transformers 5.24's `_compute_yarn_parameters`
(modeling_rope_utils.py) and DeepSeek's `yarn_get_mscale`.

`YarnScaling` holds the settings (a family's args build it: DeepseekArgs.yarn); `rope_cos_sin` (nn/rope.py) calls
`yarn_inv_freq` for a RopeConfig scaled by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's settings, HF rope_scaling's names without the prefix: the context stretch `factor` over the
    `original_max_seq_len` the model was trained at, the ramp's rotations (beta_fast, beta_slow), the mscales, an
    explicit attention_factor (None: derived from the mscales) and whether the ramp's ends are truncated."""

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = 1.0
    mscale_all_dim: Optional[float] = 1.0
    attention_factor: Optional[float] = None
    truncate: bool = True

    kind: ClassVar[str] = "yarn"  # HF rope_type

    @property
    def table_scale(self) -> float:  # cos and sin are both scaled by the attention factor
        return yarn_attention_factor(self)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 where the context is not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """The factor cos and sin are multiplied by: attention_factor where set, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) with both set, else mscale(factor)."""
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return float(yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(yarn.factor, yarn.mscale_all_dim))
    return yarn_get_mscale(yarn.factor)


def yarn_softmax_mscale(yarn: Optional[YarnScaling]) -> float:
    """The softmax scale's multiplier, mscale(factor, mscale_all_dim) ** 2 (DeepSeek's `yarn_apply_mscale`: the
    scale is head_dim ** -0.5 times it); 1.0 without YaRN (None) or without mscale_all_dim."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    mscale = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
    return mscale * mscale


def yarn_inv_freq(yarn: YarnScaling, theta: float, dim: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The (dim // 2,) inverse frequencies: interpolated by 1 / factor below the ramp, extrapolated (unchanged) above
    it, blended linearly between the dimensions that turn beta_slow and beta_fast times in the original window."""
    base, factor = theta, yarn.factor
    original = yarn.original_max_seq_len
    beta_fast, beta_slow = yarn.beta_fast or 32, yarn.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (fast turning), 0: it is interpolated
    return interpolation * (1 - keep) + extrapolation * keep
