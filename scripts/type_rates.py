"""Each tensor type's decode kernels on qwen3-30b-a3b's shapes, in GB/s of the stored bytes they read, beside
Q4_K's: the matvec of one token (the q, k and o projections) and the picked experts' three launches (top 8 of
128). Random weights; each launch reads another copy of its matrix (or other experts), so the bytes come from
HBM rather than L2; CUDA-graph timing (matvec_shapes.time_us).

    python scripts/type_rates.py [TYPE ...]     (default: every type with a decode dot)
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from matvec_shapes import time_us  # scripts/ is on the path when run as a script

from moestream.formats.quantize import quantize
from moestream.formats.quants import row_bytes
from moestream.kernels import moe_matvec
from moestream.kernels.dots import DOTS
from moestream.kernels.matvec import matvec

D, F, E, K = 2048, 768, 128, 8  # hidden size, expert width, experts, experts a token
PROJECTIONS = {"q": (4096, D), "k": (512, D), "o": (D, 4096)}  # rows, columns
HBM_BYTES = 1 << 28  # each case's copies together: several times the L2


def stored(qtype: Q, rows: int, cols: int, copies: int) -> torch.Tensor:
    """copies x [rows, cols] of qtype on the GPU: one quantized random matrix, repeated (rates do not depend on
    the values)."""
    one = quantize((np.random.default_rng(0).standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    return torch.from_numpy(one).cuda().expand(copies, *one.shape).contiguous()


def projection_rate(qtype: Q, rows: int, cols: int) -> float:
    """GB/s of the matvec of one bfloat16 token, each launch on the next copy."""
    nbytes = rows * row_bytes(qtype, cols)
    mats = stored(qtype, rows, cols, max(2, HBM_BYTES // nbytes))
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    turn = itertools.cycle(range(len(mats)))
    return nbytes / time_us(lambda: matvec(mats[next(turn)], qtype, rows, x)) / 1e3


def picked_rate(qtype: Q) -> float:
    """GB/s of one token's gate, up and down of K experts (swiglu_picked), other experts each launch."""
    copies = max(1, HBM_BYTES // (3 * E * F * row_bytes(qtype, D)))
    raws = [stored(qtype, F, D, E * copies), stored(qtype, F, D, E * copies), stored(qtype, D, F, E * copies)]
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(1, K, device="cuda"), -1).bfloat16()
    picks = [torch.randperm(E * copies, device="cuda")[:K][None] for _ in range(64)]
    turn = itertools.cycle(picks)
    qtypes = (qtype, qtype, qtype)
    nbytes = K * (2 * F * row_bytes(qtype, D) + D * row_bytes(qtype, F))
    return nbytes / time_us(lambda: moe_matvec.swiglu_picked(x, weights, next(turn), raws, qtypes, F)) / 1e3


def main(names: list[str]) -> None:
    qtypes = [Q[n] for n in names] if names else [q for q in DOTS if q != Q.Q4_K]
    cases = [*PROJECTIONS, "experts"]
    print(f"{'type':<8} " + " ".join(f"{c:>14}" for c in cases) + "   (GB/s, and the share of Q4_K's)")
    base = None
    for qtype in [Q.Q4_K, *qtypes]:
        rates = [projection_rate(qtype, *PROJECTIONS[c]) for c in PROJECTIONS] + [picked_rate(qtype)]
        base = base or rates
        cells = [f"{r:7.0f} ({r / b:4.0%})" for r, b in zip(rates, base, strict=True)]
        print(f"{qtype.name:<8} " + " ".join(f"{c:>14}" for c in cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
