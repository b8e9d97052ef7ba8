"""YaRN RoPE scaling (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2/V3 use it: the frequencies, the tables'
attention factor and the softmax scale's mscale, computed exactly as transformers 5.24's `_compute_yarn_parameters`
(modeling_rope_utils.py) and DeepSeek's `yarn_get_mscale`.

The settings are read from a family's args by these field names (None factor: no YaRN):
yarn_factor, yarn_original_max_seq_len, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim,
yarn_attention_factor (None: derived from the mscales), yarn_truncate. `rope_cos_sin` (nn/decoder.py) calls
`yarn_inv_freq` when yarn_factor is set.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 where the context is not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(args: Any) -> float:
    """The factor cos and sin are multiplied by: yarn_attention_factor where set, else
    mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) with both set, else mscale(factor)."""
    if args.yarn_attention_factor is not None:
        return float(args.yarn_attention_factor)
    if args.yarn_mscale and args.yarn_mscale_all_dim:
        return float(yarn_get_mscale(args.yarn_factor, args.yarn_mscale)
                     / yarn_get_mscale(args.yarn_factor, args.yarn_mscale_all_dim))
    return yarn_get_mscale(args.yarn_factor)


def yarn_softmax_mscale(args: Any) -> float:
    """The softmax scale's multiplier, mscale(factor, yarn_mscale_all_dim) ** 2 (DeepSeek's
    `yarn_apply_mscale`: the scale is head_dim ** -0.5 times it); 1.0 without YaRN or without mscale_all_dim."""
    if getattr(args, "yarn_factor", None) is None or not args.yarn_mscale_all_dim:
        return 1.0
    mscale = yarn_get_mscale(args.yarn_factor, args.yarn_mscale_all_dim)
    return mscale * mscale


def yarn_inv_freq(args: Any, dim: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The (dim // 2,) inverse frequencies: interpolated by 1 / factor below the ramp, extrapolated (unchanged) above
    it, blended linearly between the dimensions that turn beta_slow and beta_fast times in the original window."""
    base, factor = args.rope_theta, args.yarn_factor
    original = args.yarn_original_max_seq_len
    beta_fast, beta_slow = args.yarn_beta_fast or 32, args.yarn_beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if args.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (fast turning), 0: it is interpolated
    return interpolation * (1 - keep) + extrapolation * keep
