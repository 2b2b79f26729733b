"""This machine's floors: host-to-device link rates (pinned, pageable, a mapped file page-locked in place) and
the grouped expert GEMM rate, measured here."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from moestream.formats.gguf import torch_bytes_of
from moestream.offload.host import PinnedRanges
from moestream.ops.moe_swiglu import moe_swiglu


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds per call of fn: CUDA events on a GPU (after warm-up), the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def h2d_rate(device: torch.device, nbytes: int = 1 << 30, pinned: bool = True, repeats: int = 5) -> float:
    """Host-to-device bytes per second from a pinned (or pageable) buffer of random bytes."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    if pinned and device.type == "cuda":
        src = src.pin_memory()
    return copy_rate(src, device, repeats, non_blocking=pinned)


def copy_rate(src: torch.Tensor, device: torch.device, repeats: int = 5, non_blocking: bool = True) -> float:
    """Bytes per second uploading the host bytes src [N] uint8 to device as they are (pinned, page-locked in
    place by the caller, or pageable)."""
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    return src.numel() / min(timed(lambda: dst.copy_(src, non_blocking=non_blocking), device, repeats))


def registered_rate(device: torch.device, array: np.ndarray, repeats: int = 5) -> float:
    """Bytes per second uploading a slice of a mapped file page-locked in place (0 if page-locking is refused)."""
    pins = PinnedRanges()
    if not pins.register([array]):
        return 0.0
    try:
        return copy_rate(torch_bytes_of(array).reshape(-1), device, repeats)
    finally:
        pins.unregister()


def grouped_gemm_rate(
    n_tokens: int,
    n_embd: int,
    n_ff: int,
    n_expert: int,
    n_used: int,
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """FLOP/s of one MoE layer's grouped SwiGLU on random routing (the compute side of the floors)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n_tokens, n_embd, device=device, dtype=dtype, generator=g)
    gate = torch.randn(n_expert, n_ff, n_embd, device=device, dtype=dtype, generator=g) * 0.02
    up = torch.randn(n_expert, n_ff, n_embd, device=device, dtype=dtype, generator=g) * 0.02
    down = torch.randn(n_expert, n_embd, n_ff, device=device, dtype=dtype, generator=g) * 0.02
    ids = torch.rand(n_tokens, n_expert, device=device, generator=g).topk(n_used, dim=-1).indices
    w = torch.full((n_tokens, n_used), 1.0 / n_used, device=device, dtype=dtype)
    t = timed(lambda: moe_swiglu(x, w, ids, n_expert, gate, up, down), device, repeats=5)
    return 6 * n_tokens * n_used * n_embd * n_ff / min(t)
