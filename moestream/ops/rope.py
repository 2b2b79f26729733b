"""Rotary position embedding: the cos / sin tables of positions, and the rotation (alone, or fused with the
RMSNorm q and k take before it).

Legend: T = tokens, H = heads, Dh = head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream.kernels import fused
from moestream.ops.norm import rms_norm
from moestream.ops.yarn import YaRN


def yarn_angle_scale(yarn: YaRN, rot_dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """[rot_dim/2] multipliers of each pair's unscaled angle."""
    low, high = yarn.corr_dims(rot_dim, base)
    pair = torch.arange(rot_dim // 2, device=device, dtype=torch.float32)
    extrapolated = (1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)) * yarn.ext_factor
    return (1 - extrapolated) / yarn.factor + extrapolated


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, base: float, dtype: torch.dtype, yarn: YaRN | None = None):
    """cos, sin [T, rot_dim/2] for NEOX-style rotation of the first rot_dim channels (YaRN-scaled if given)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.float32) / rot_dim))
    if yarn is not None:
        inv_freq = inv_freq * yarn_angle_scale(yarn, rot_dim, base, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if yarn is None or yarn.mscale == 1.0:
        return freqs.cos().to(dtype), freqs.sin().to(dtype)
    return (freqs.cos() * yarn.mscale).to(dtype), (freqs.sin() * yarn.mscale).to(dtype)


def imrope_text_cos_sin(
    positions: torch.Tensor, rot_dim: int, base: float, sections: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rot_dim/2] of interleaved multi-section RoPE (llama.cpp's imrope) for text tokens.

    Pair i belongs to section i % 3 (time, height, width) while i < 3 * sections[i % 3], otherwise to the 4th
    section. Text gives the first three the token's position and the 4th position 0: those pairs do not turn.
    """
    cos, sin = rope_cos_sin(positions, rot_dim, base, dtype)
    pair = torch.arange(rot_dim // 2, device=positions.device)
    section = pair % 3
    limit = torch.where(section == 0, 3 * sections[0], torch.where(section == 1, 3 * sections[1], 3 * sections[2]))
    text = pair < limit  # built from scalars: no host-to-device copy, so a CUDA graph can capture it
    return torch.where(text, cos, 1.0), torch.where(text, sin, 0.0)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2*cos.shape[-1] channels of x [T, H, Dh]; the rest pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """rope_neox(rms_norm(x, weight, eps), cos, sin) for x [T, H, Dh]: q and k before attention. weight None:
    the RoPE alone (a model without q/k norms)."""
    if weight is None:
        return rope_neox(x, cos, sin)
    if fused.usable(x) and weight.dtype == x.dtype == cos.dtype:
        return fused.rms_norm(x, weight, eps, cos.contiguous(), sin.contiguous())
    return rope_neox(rms_norm(x, weight, eps), cos, sin)
