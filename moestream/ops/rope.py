"""Rotary position embedding: the cos / sin tables of positions, and the rotation (alone, or fused with the
RMSNorm q and k take before it).

Legend: T = tokens, H = heads, Dh = head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moestream.kernels import fused
from moestream.ops.norm import rms_norm


@dataclass(frozen=True)
class YaRN:
    """YaRN context extension as llama.cpp applies it (ggml's rope with ext_factor): each pair's angle mixes
    the interpolated angle (position / factor) with the original one by a ramp over the pair index between
    the correction dims, which llama.cpp rounds (floor, ceil) where the paper does not; cos and sin are
    scaled by mscale."""

    factor: float  # context scaling (rope.scaling.factor): angles divided by it where interpolated
    n_ctx_orig: int  # the context the model was trained at (rope.scaling.original_context_length)
    beta_fast: float = 32.0  # rotations that bound the ramp: pairs turning faster are extrapolated
    beta_slow: float = 1.0  # ... and pairs turning slower than this are interpolated
    ext_factor: float = 1.0  # weight of the extrapolated angle on the ramp; 0 interpolates every pair
    mscale: float = 1.0  # cos and sin times this

    def corr_dims(self, rot_dim: int, base: float) -> tuple[float, float]:
        """The ramp's bounds in pair indices, rounded outwards and clamped to the rotated pairs."""

        def dim(rotations: float) -> float:
            return rot_dim * math.log(self.n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        return max(0.0, math.floor(dim(self.beta_fast))), min(rot_dim - 1.0, math.ceil(dim(self.beta_slow)))

    def angle_scale(self, rot_dim: int, base: float, device: torch.device) -> torch.Tensor:
        """[rot_dim/2] multipliers of each pair's unscaled angle."""
        low, high = self.corr_dims(rot_dim, base)
        pair = torch.arange(rot_dim // 2, device=device, dtype=torch.float32)
        extrapolated = (1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)) * self.ext_factor
        return (1 - extrapolated) / self.factor + extrapolated


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, base: float, dtype: torch.dtype, yarn: YaRN | None = None):
    """cos, sin [T, rot_dim/2] for NEOX-style rotation of the first rot_dim channels (YaRN-scaled if given)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.float32) / rot_dim))
    if yarn is not None:
        inv_freq = inv_freq * yarn.angle_scale(rot_dim, base, positions.device)
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
