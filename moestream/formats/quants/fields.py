"""Byte fields of stored blocks as torch tensors, shared by the reference dequants."""

from __future__ import annotations

import torch


def split_bits(x: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """(..., m) bytes -> (..., count, m) fields of `bits` bits, lowest field first."""
    mask = (1 << bits) - 1
    return torch.stack([(x >> (bits * i)) & mask for i in range(count)], dim=-2)


def f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block, as float32 of shape (n_blocks, 1)."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)
