"""An experiment for issue 32: are the grid IQ types' decode dots bound by their scattered table reads? IQ2_XXS's
decode matvec as the library runs it (each quad of four values a load of bfloat16 values from the grid's 4 KiB
table) beside the same launch whose dot reads the grid row as one word of 2-bit codes (8, 25 or 43) from a 1 KiB
table and makes the values by arithmetic: fewer cache lines a warp's gather touches, more instructions. Same
blocks, same products in the same order: the outputs must be equal, and the rates say which bound holds.

    python scripts/grid_codes.py            (on a GPU; TRITON_INTERPRET=1 on the CPU checks the outputs only)
"""

from __future__ import annotations

import functools
import itertools
from unittest import mock

import numpy as np
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q
from matvec_shapes import time_us  # scripts/ is on the path when run as a script

from moestream.formats.quantize import quantize
from moestream.formats.quants import grids, row_bytes
from moestream.kernels import dots
from moestream.kernels.dequant import iq2_xxs_fields
from moestream.kernels.matvec import matvec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"q": (4096, 2048), "o": (2048, 4096)}  # qwen3-30b-a3b's rows, columns
HBM_BYTES = 1 << 28  # each case's copies together: several times the L2


@functools.cache
def codes_table(qtype: Q, device: torch.device) -> torch.Tensor:
    """In kernel_table's place for IQ2_XXS: its 256 grid rows as int32 words of eight 2-bit codes (value j at
    bits 2 j: 0, 1, 2 for 8, 25, 43)."""
    g = grids.grid_values(qtype)
    codes = np.select([g == 8, g == 25, g == 43], [0, 1, 2]).astype(np.int64)
    words = (codes << (2 * np.arange(8))).sum(axis=1)
    return torch.from_numpy(words.astype(np.int32)).to(device)


@triton.jit
def _iq2_codes_dot(base, xb, ok, table):
    """_grid_dot's [R, B, 8 sub-blocks, 4 groups, 2 quads] with the quad's four values from its byte of the grid
    row's code word: value 8 + 17 c + c // 2, exact as a float (dots._exact_f32), its sign bit XORed in."""
    base, xb, ok = base[:, :, :, None, None], xb[:, :, :, None, None], ok[:, :, :, None, None]
    s = tl.arange(0, 8)[None, None, :, None, None]
    g = tl.arange(0, 4)[None, None, None, :, None]
    q = tl.arange(0, 2)[None, None, None, None, :]
    x4 = tl.load(xb.to(tl.pointer_type(tl.int64)) + 8 * s + 2 * g + q)
    scale, gq, signs = iq2_xxs_fields(base, s, g, q, ok, True)
    codes = tl.load(table + (gq >> 1)) >> (8 * q)  # gq: the quad's place in the bfloat16 table, 2 a row
    nibble = signs >> (4 * q)
    acc = tl.zeros_like(scale)
    for i in tl.static_range(4):
        c = (codes >> (2 * i)) & 3
        v = dots._exact_f32(8 + 17 * c + (c >> 1)).to(tl.int32, bitcast=True) ^ (((nibble >> i) & 1) << 31)
        acc += v.to(tl.float32, bitcast=True) * dots._bf16_of(x4, i)
    return tl.sum(scale * acc, axis=4)


def compare(rows: int, cols: int) -> str:
    """Both dots on copies of one random IQ2_XXS matrix: whether their outputs are equal, and on a GPU the GB/s of
    stored bytes of each (each launch on the next copy, so the bytes come from HBM)."""
    one = quantize((np.random.default_rng(0).standard_normal((rows, cols)) * 0.05).astype(np.float32), Q.IQ2_XXS)
    nbytes = rows * row_bytes(Q.IQ2_XXS, cols)
    copies = max(2, HBM_BYTES // nbytes) if DEVICE == "cuda" else 1
    mats = torch.from_numpy(one).to(DEVICE).expand(copies, *one.shape).contiguous()
    x = torch.randn(1, cols, device=DEVICE, dtype=torch.bfloat16)

    def rate() -> float:
        turn = itertools.cycle(range(copies))
        return nbytes / time_us(lambda: matvec(mats[next(turn)], Q.IQ2_XXS, rows, x)) / 1e3

    library = matvec(mats[0], Q.IQ2_XXS, rows, x)
    rates = [rate()] if DEVICE == "cuda" else []
    with mock.patch.dict(dots.DOTS, {Q.IQ2_XXS: _iq2_codes_dot}), mock.patch.object(grids, "kernel_table", codes_table):
        coded = matvec(mats[0], Q.IQ2_XXS, rows, x)
        rates += [rate()] if DEVICE == "cuda" else []
    same = torch.equal(library, coded)
    speed = f"library {rates[0]:7.1f} GB/s, codes {rates[1]:7.1f} GB/s, " if rates else "(no GPU: outputs only) "
    return f"IQ2_XXS {rows}x{cols}: {speed}outputs equal: {same}"


def main() -> None:
    for rows, cols in SHAPES.values():
        print(compare(rows, cols), flush=True)


if __name__ == "__main__":
    main()
