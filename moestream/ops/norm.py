"""RMSNorm, alone or after a residual add: one kernel on a GPU (decode is launch-bound), else torch."""

from __future__ import annotations

import torch

from moestream.kernels import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, over the last dim."""
    if fused.usable(x) and weight.dtype == x.dtype:  # one kernel instead of seven
        return fused.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x + r (with bias, x + (r + bias): an output projection's bias added here, not
    in a launch of its own): a layer's residual add and the norm in front of its MoE block."""
    if fused.usable(x) and x.dtype == r.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        return fused.add_rms_norm(x, r, weight, eps, bias)  # one kernel for all
    if bias is not None:
        r = r + bias
    h = x + r
    return h, rms_norm(h, weight, eps)
