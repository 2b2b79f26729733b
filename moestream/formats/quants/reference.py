"""Dequantize GGUF tensor types with plain torch ops, on whatever device holds the raw bytes.

Expert weights are uploaded to the GPU as stored blocks and expanded there, so every reference takes a
uint8 tensor of whole blocks and runs on CPU or CUDA alike. The float32 results match gguf's numpy
reference bit for bit: each forms the same float32 products in the same order.
"""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from moestream.errors import MoestreamError
from moestream.formats.quants.registry import get
from moestream.formats.quants.tensor_type import row_bytes

# Elements expanded per step. On CPU, 4M (16 MiB float32 temporaries) measured fastest: larger steps pay
# page faults on fresh allocations. On the GPU, larger steps mean fewer kernel launches; 64 MiB bounds VRAM.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24


def scratch_bytes(n_elements: int, device_type: str) -> int:
    """Temporaries one dequantize of n_elements makes besides its output: a step's float32 values and the
    integer fields they are made from (about 1.5x the step's float32 in the K-quants; counted as 2x)."""
    return 2 * 4 * min(n_elements, _CHUNK_ELEMENTS.get(device_type, _CHUNK_ELEMENTS_DEFAULT))


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Expand stored bytes (uint8, any shape) into a `shape` tensor of `dtype` on raw's device.

    `shape` is in numpy order (last dim = elements per row). Computes in float32, then casts.
    """
    entry = get(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must hold uint8 bytes, got {raw.dtype}")
    n_bytes = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
    if raw.numel() != n_bytes:
        raise MoestreamError(f"{qtype.name} tensor of shape {tuple(shape)} needs {n_bytes} bytes, got {raw.numel()}")
    blocks = raw.reshape(-1, entry.type_size)
    out = torch.empty(blocks.shape[0], entry.block, dtype=dtype, device=raw.device)
    step = max(1, _CHUNK_ELEMENTS.get(raw.device.type, _CHUNK_ELEMENTS_DEFAULT) // entry.block)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = entry.reference(blocks[start : start + step])
    return out.reshape(shape)
