"""Quantized matrix-vector products for a few tokens (decode): y = W x straight from the stored blocks.

Dequantizing a weight to bf16 and then multiplying writes and reads it twice more than it is stored; for a
token or two that traffic, plus the extra launches, is the whole cost. These kernels read each block once,
dequantize it in registers (the tiles of kernels/dequant.py) and accumulate in float32. The blocks may lie in
device memory or in page-locked host memory, which the kernel then reads over the link itself, like
kernels/gather.py. A stack of matrices (experts) is indexed per row of x, with the indices on the device.
"""

from __future__ import annotations

import contextlib

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.kernels.dequant import TILES, triton

ROWS_PER_PROGRAM = 16
MAX_TOKENS = 4  # above this, dequantizing once and multiplying on the tensor cores is cheaper

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _matvec_kernel(
        w,
        x,
        y,
        mats,
        n_out,
        row_bytes,
        N_BLOCKS: tl.constexpr,  # blocks per row (a handful of sizes per model: unrolled)
        TILE: tl.constexpr,
        ELEMS: tl.constexpr,
        SIZE: tl.constexpr,
        STACKED: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        p = tl.program_id(1).to(tl.int64)  # which row of x (a token, or a token-expert pair)
        out = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] output rows
        ok = (out < n_out)[:, None]
        mat = tl.load(mats + p).to(tl.int64) if STACKED else 0
        row = w + (mat * n_out + out[:, None].to(tl.int64)) * row_bytes  # [ROWS, 1] first block of each row
        e = tl.arange(0, ELEMS)[None, :]
        acc = tl.zeros([ROWS, ELEMS], dtype=tl.float32)
        for j in range(N_BLOCKS):
            xv = tl.load(x + p * N_BLOCKS * ELEMS + j * ELEMS + e).to(tl.float32)  # [1, ELEMS]
            acc += TILE(row + j * SIZE, e, ok) * xv
        tl.store(y + p * n_out + out, tl.sum(acc, axis=1), mask=out < n_out)


def usable(x: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether matvec serves x [T, in] against a weight of this type here."""
    return qtype in TILES and x.is_cuda and x.shape[0] <= MAX_TOKENS


def matvec(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    n_out: int,
    x: torch.Tensor,
    mats: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [P, n_out] = W_p x[p] for each row p of x [P, in], in x's dtype.

    raw holds the stored bytes of one matrix [n_out, in] (mats None) or of a stack [E, n_out, in], in which
    case mats [P] (int64, on x's device) says which matrix each row of x multiplies. raw may be a CUDA tensor
    or page-locked host memory that the GPU can address."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_in = x.shape[-1]
    x = x.contiguous()
    y = torch.empty((x.shape[0], n_out), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_out, ROWS_PER_PROGRAM), x.shape[0])
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _matvec_kernel[grid](
            raw,
            x,
            y,
            mats if mats is not None else x,  # unread when not stacked
            n_out,
            n_in // block * type_size,
            N_BLOCKS=n_in // block,
            TILE=TILES[qtype],
            ELEMS=block,
            SIZE=type_size,
            STACKED=mats is not None,
            ROWS=ROWS_PER_PROGRAM,
        )
    return y.to(x.dtype)
