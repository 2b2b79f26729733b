"""Plain float types, one value a block."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q


def _f32(b: torch.Tensor) -> torch.Tensor:
    """F32: one 4-byte float per block."""
    return b.contiguous().view(torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """F16: one 2-byte half per block."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    """BF16: one 2-byte bfloat16 per block (the high half of a float32)."""
    return b.contiguous().view(torch.bfloat16).to(torch.float32)


REFERENCES = {
    Q.F32: _f32,
    Q.F16: _f16,
    Q.BF16: _bf16,
}
