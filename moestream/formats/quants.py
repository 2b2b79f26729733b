"""Dequantize GGUF tensor types with plain torch ops, on whatever device holds the raw bytes.

Expert weights are uploaded to the GPU as stored blocks and expanded there, so every function here takes
a uint8 tensor of whole blocks and runs on CPU or CUDA alike. The float32 results match gguf's numpy
reference bit for bit: each function forms the same float32 products in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError

Q = GGMLQuantizationType

# Elements expanded per step. On CPU, 4M (16 MiB float32 temporaries) measured fastest: larger steps pay
# page faults on fresh allocations. On the GPU, larger steps mean fewer kernel launches; 64 MiB bounds VRAM.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one stored row of n_cols elements."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise MoestreamError(f"a row of {n_cols} is not a whole number of {qtype.name} blocks of {block}")
    return n_cols // block * type_size


def _split_bits(x: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """(..., m) bytes -> (..., count, m) fields of `bits` bits, lowest field first."""
    mask = (1 << bits) - 1
    return torch.stack([(x >> (bits * i)) & mask for i in range(count)], dim=-2)


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block, as float32 of shape (n_blocks, 1)."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _f32(b: torch.Tensor) -> torch.Tensor:
    """F32: one 4-byte float per block."""
    return b.contiguous().view(torch.float32)


def _f16_type(b: torch.Tensor) -> torch.Tensor:
    """F16: one 2-byte half per block."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    """BF16: one 2-byte bfloat16 per block (the high half of a float32)."""
    return b.contiguous().view(torch.bfloat16).to(torch.float32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """Q8_0 (34 B / 32): d f16, qs int8[32]; x = q * d."""
    q = b[:, 2:].view(torch.int8).to(torch.float32)
    return q.mul_(_f16(b, 0))


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return _split_bits(qs, 4, 2).reshape(qs.shape[0], 32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> 32 bits, bit j belonging to element j."""
    return _split_bits(qh, 1, 8).transpose(1, 2).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """Q4_0 (18 B / 32): d f16, qs[16] nibbles; x = d * (q - 8)."""
    q = (_nibbles32(b[:, 2:18]).view(torch.int8) - 8).to(torch.float32)
    return q.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """Q4_1 (20 B / 32): d f16, m f16, qs[16] nibbles; x = d * q + m."""
    q = _nibbles32(b[:, 4:20]).to(torch.float32)
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """Q5_0 (22 B / 32): d f16, qh[4] fifth bits, qs[16] nibbles; x = d * (q - 16)."""
    q = _nibbles32(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)
    return (q.view(torch.int8) - 16).to(torch.float32).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """Q5_1 (24 B / 32): d f16, m f16, qh[4] fifth bits, qs[16] nibbles; x = d * q + m."""
    q = (_nibbles32(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4)).to(torch.float32)
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K (84 B / 256): scales[16] (4-bit scale | 4-bit min << 4), qs[64] 2-bit, d f16, dmin f16."""
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _split_bits(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K (110 B / 256): hmask[32] third bits, qs[64] 2-bit, scales[12] 6-bit signed, d f16."""
    n = b.shape[0]
    low = _split_bits(b[:, 96:104], 4, 2).reshape(n, 16)
    high = _split_bits(b[:, 104:108], 2, 4).reshape(n, 16)
    scales = ((low | (high << 4)).view(torch.int8) - 32).to(torch.float32)
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    ql = _split_bits(b[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    # A clear mask bit subtracts 4; a set one leaves the 2-bit value as is.
    qh = _split_bits(b[:, :32], 1, 8).reshape(n, 16, 16) ^ 1
    q = (ql.view(torch.int8) - (qh << 2).view(torch.int8)).to(torch.float32)
    return q.mul_(dl).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte field of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = (d * scale) * q - (dmin * min) over 8 sub-blocks of 32, shared by Q4_K and Q5_K."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    return q.to(torch.float32).mul_(d).sub_(dm).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K (144 B / 256): d f16, dmin f16, scales[12] 6-bit, qs[128] nibbles."""
    n = b.shape[0]
    return _k_affine(b, _split_bits(b[:, 16:144].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q5_K (176 B / 256): d f16, dmin f16, scales[12] 6-bit, qh[32] fifth bits, qs[128] nibbles."""
    n = b.shape[0]
    ql = _split_bits(b[:, 48:176].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    qh = _split_bits(b[:, 16:48], 1, 8)
    return _k_affine(b, ql | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K (210 B / 256): ql[128] nibbles, qh[64] 2-bit, scales[16] int8, d f16; x = d * scale * (q - 32)."""
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    ql = _split_bits(b[:, :128].reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    qh = _split_bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(d).reshape(n, 256)


_DEQUANTIZE: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_type,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZE)


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Expand stored bytes (uint8, any shape) into a `shape` tensor of `dtype` on raw's device.

    `shape` is in numpy order (last dim = elements per row). Computes in float32, then casts.
    """
    fn = _DEQUANTIZE.get(qtype)
    if fn is None:
        name, names = getattr(qtype, "name", qtype), ", ".join(t.name for t in sorted(SUPPORTED))
        raise MoestreamError(f"tensor type {name} is not supported (supported: {names})")
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must hold uint8 bytes, got {raw.dtype}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_bytes = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
    if raw.numel() != n_bytes:
        raise MoestreamError(f"{qtype.name} tensor of shape {tuple(shape)} needs {n_bytes} bytes, got {raw.numel()}")
    blocks = raw.reshape(-1, type_size)
    out = torch.empty(blocks.shape[0], block, dtype=dtype, device=raw.device)
    step = max(1, _CHUNK_ELEMENTS.get(raw.device.type, _CHUNK_ELEMENTS_DEFAULT) // block)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.reshape(shape)
