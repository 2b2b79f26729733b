"""Grouped expert matmul: one call for all experts of a layer.

Fast path: torch._grouped_mm (CUDA, bf16, Hopper and newer), no host sync.
Fallback: a loop over the experts that received tokens (CPU, other dtypes, unaligned shapes); it reads the
group sizes on the host, which costs a sync that only matters on a GPU.
"""

from __future__ import annotations

import torch


def runs_on_device(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether grouped_mm over these matrix sizes takes the fast path, which never syncs with the host
    (so a CUDA graph can capture it)."""
    return (
        hasattr(torch, "_grouped_mm")
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and all(d % 8 == 0 for d in dims)
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def _use_grouped_mm(x: torch.Tensor, w_t: torch.Tensor) -> bool:
    return w_t.dtype == x.dtype and runs_on_device(x.device, x.dtype, x.shape[-1], w_t.shape[-1])


def grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x (sorted by expert) times w_t[e]. x [M, K], w_t [E, K, N], offs [E] int32 ends."""
    if _use_grouped_mm(x, w_t):
        return torch._grouped_mm(x, w_t, offs=offs)
    out = x.new_empty(x.shape[0], w_t.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):  # host sync: fallback path only
        if end > start:
            out[start:end] = x[start:end] @ w_t[e]
        start = end
    return out
