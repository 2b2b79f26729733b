"""YaRN context extension's parameters, as a file states them (models/layouts/gpt_oss.py reads them), and its
correction range: plain numbers, so reading a file needs no torch; ops/rope.py turns them into angles."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
