"""What every Triton launch here shares: Triton itself (absent on CPU-only installs), the device to launch on,
and programmatic dependent launch (PDL) for the decode kernels."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from moestream.kernels import compiles, tuning

try:  # Triton ships with CUDA builds of torch; CPU-only installs take the reference paths
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Triton's interpreter runs CUDA tensors too, and cannot run PDL's inline PTX; read once, as Triton reads it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if triton is not None:
    compiles.watch_triton(triton)  # a first-use compile is said on stderr, and counted


def on_device(t: torch.Tensor):
    """Triton launches on the current device: make it t's (say --device cuda:1); nothing for CPU tensors (the
    interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def pdl(t: torch.Tensor) -> dict:
    """A decode kernel's launch options for tensors like t: its PDL constexpr and Triton's launch_pdl. Under
    PDL a kernel may be scheduled while the one before it in the stream still runs and waits on the GPU
    before it touches memory, so a launch's gap hides behind the kernel before it (Hopper and later)."""
    on = tuning.current().pdl and t.is_cuda and not INTERPRETED and _capability(t.device) >= (9, 0)
    return dict(PDL=on, launch_pdl=on)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """device's multiprocessor count (0 for the CPU, where Triton interprets)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A decode kernel's first step: under PDL, wait until the grids before it have finished and their
        writes are visible, then let the next kernel be scheduled (it waits the same way)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
