"""Where the kernel tests run: CUDA, or Triton's interpreter (TRITON_INTERPRET=1, triton importable), which
runs the kernels on CPU tensors, e.g. before device time is spent (float32 only checked tightly there)."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels.launch import INTERPRETED as TRITON_INTERPRET
from moestream.kernels.launch import triton

INTERPRETED = TRITON_INTERPRET and triton is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gpu_or_interpreter = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED), reason="needs CUDA or Triton's interpreter"
)


def as_kernel_rounds(y: torch.Tensor) -> torch.Tensor:
    """float32 y stored as bfloat16 the way the kernels' stores convert it: to nearest on the GPU, by cutting
    the low 16 bits in Triton's interpreter."""
    if INTERPRETED:
        y = (y.view(torch.int32) & -65536).view(torch.float32)
    return y.bfloat16()
