"""The KV cache's types (-ctk/-ctv): floats, and llama.cpp's Q8_0 and Q4_0 blocks of 32 values (q8_0: an f16
scale then 32 int8, value q*d; q4_0: an f16 scale then 16 bytes of nibbles, value (q-8)*d, the low nibbles
holding values 0..15 and the high ones 16..31). Rows are quantized as gguf.quants.quantize does, bit for bit:
a torch form (the reference, and the engine's on CPU) and a Triton kernel (one launch, the engine's on CUDA; neither
reads the host, so a captured decode step can write its rows).

Legend: N = rows, C = values a row (a multiple of 32), B = bytes a row (C / 32 blocks of BLOCK_BYTES).
"""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError
from moestream.kernels.launch import on_device, triton

BLOCK = 32  # values a block
FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
KIND = {"q8_0": 1, "q4_0": 2}  # the kernels' constexpr for a quantized type (0: a float tensor)


def row_bytes(name: str, n_values: int) -> int:
    """Bytes of one cache row of n_values values stored as type name."""
    if name in FLOATS:
        return n_values * FLOATS[name].itemsize
    if n_values % BLOCK:
        raise MoestreamError(
            f"a {name} KV cache needs rows of a multiple of {BLOCK} values; this model's are {n_values}: "
            "use -ctk/-ctv f16"
        )
    return n_values // BLOCK * BLOCK_BYTES[name]


def quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """Rows x [N, C] (any float dtype) as blocks [N, B] uint8, bit-exact with gguf.quants.quantize."""
    row_bytes(name, x.shape[-1])
    x = x.reshape(x.shape[0], -1)
    return _quantize_triton(x, name) if x.is_cuda and triton is not None else quantize_torch(x, name)


def quantize_torch(x: torch.Tensor, name: str) -> torch.Tensor:
    """quantize's torch form: gguf's float32 operations in the same order."""
    n = x.shape[0]
    b = x.float().reshape(-1, BLOCK)
    if name == "q8_0":
        d = b.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        a = (b * inv).abs()
        floored = a.floor()
        qs = (torch.sign(b * inv) * (floored + (2 * (a - floored)).floor())).to(torch.int8).view(torch.uint8)
    else:
        big = torch.gather(b, 1, b.abs().argmax(dim=1, keepdim=True))  # the first of equal magnitudes, as numpy
        d = big / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
        qs = q[:, : BLOCK // 2] | (q[:, BLOCK // 2 :] << 4)
    scale = d.to(torch.float16).view(torch.uint8)  # [blocks, 2]
    return torch.cat([scale, qs], dim=1).reshape(n, -1)


def dequantize(blocks: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [N, B] as values [N, C] in dtype (float rows are only cast)."""
    if name in FLOATS:
        return blocks.to(dtype)
    n = blocks.shape[0]
    b = blocks.reshape(-1, BLOCK_BYTES[name])
    d = b[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if name == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()
    else:
        nib = b[:, 2:]
        q = torch.cat([nib & 15, nib >> 4], dim=1).float() - 8
    return (q * d).to(dtype).reshape(n, -1)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize_kernel(x, out, n_blocks, KIND: tl.constexpr, BYTES: tl.constexpr, BLOCKS: tl.constexpr):
        """BLOCKS blocks of 32 values each program (rows are whole blocks, so blocks run on across rows)."""
        blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        ok = blk < n_blocks
        j = tl.arange(0, 32)
        b = tl.load(x + blk[:, None] * 32 + j[None, :], mask=ok[:, None], other=0).to(tl.float32)
        if KIND == 1:
            d = tl.max(tl.abs(b), axis=1) / 127
        else:  # the signed value of the largest magnitude, the first one of ties (numpy's argmax)
            mag = tl.abs(b)
            top = tl.max(mag, axis=1)
            first = tl.min(tl.where(mag == top[:, None], j[None, :], 32), axis=1)
            d = tl.sum(tl.where(j[None, :] == first[:, None], b, 0.0), axis=1) / -8
        inv = tl.where(d == 0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d))
        y = b * inv[:, None]
        base = out + blk * BYTES
        # the scale through a float16 pointer (blocks are 2-byte aligned): storing its bitcast low byte, ptxas
        # (CUDA 13, sm_90) turned the byte store of the f16 register into a float-to-u8 conversion (0 for d < 1)
        tl.store(base.to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=ok)
        if KIND == 1:  # round half away from zero, as gguf's np_roundf
            a = tl.abs(y)
            fl = tl.floor(a)
            r = fl + tl.floor(2 * (a - fl))
            q = tl.where(y < 0, -r, r).to(tl.int8).to(tl.uint8, bitcast=True)
            tl.store(base[:, None] + 2 + j[None, :], q, mask=ok[:, None])
        else:
            q = tl.minimum(tl.maximum(tl.floor(y + 8.5), 0.0), 15.0).to(tl.uint8)  # y + 8.5 > 0: floor is trunc
            half = tl.arange(0, 16)
            low, high = tl.split(tl.permute(tl.reshape(q, [BLOCKS, 2, 16]), [0, 2, 1]))  # values j, j + 16
            tl.store(base[:, None] + 2 + half[None, :], low | (high << 4), mask=ok[:, None])


def _quantize_triton(x: torch.Tensor, name: str) -> torch.Tensor:
    x = x.contiguous()
    n_blocks = x.numel() // BLOCK
    out = torch.empty((x.shape[0], x.shape[1] // BLOCK * BLOCK_BYTES[name]), dtype=torch.uint8, device=x.device)
    blocks = 16
    with on_device(x):
        _quantize_kernel[(triton.cdiv(n_blocks, blocks),)](
            x, out, n_blocks, KIND=KIND[name], BYTES=BLOCK_BYTES[name], BLOCKS=blocks
        )
    return out


def quantize_kernel(x: torch.Tensor, name: str) -> torch.Tensor:
    """The Triton form on any device Triton runs (the interpreter's CPU tensors too)."""
    return _quantize_triton(x.reshape(x.shape[0], -1), name)
