"""Each tensor type's decode kernels on qwen3-30b-a3b's shapes, in GB/s of stored bytes, beside Q4_K's (issue 32):
the output head's matvec [151936 x 2048] and one token's 8 picked experts of 128 (gate, up 768 x 2048, down
2048 x 768) through swiglu_picked. Weights are random normal rows quantized by the project's quantizer and tiled
(never zeros); successive calls pick disjoint experts so the picked bytes come from HBM, not L2. CUDA graphs of
many calls after warm-up, timed with CUDA events.

    python scripts/type_bench.py [TYPE ...]
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats import quants
from moestream.formats.quantize import QUANTIZABLE, quantize
from moestream.kernels import dots, matvec, moe_matvec

D, FF, E, K, VOCAB = 2048, 768, 128, 8, 151936
DTYPE = torch.bfloat16


def stored(qtype: Q, rows: int, cols: int, copies: int, seed: int) -> torch.Tensor:
    """copies x [rows, cols] of qtype on the GPU: one quantized random matrix, repeated."""
    x = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.02
    one = torch.from_numpy(quantize(x, qtype)).cuda()
    return one.unsqueeze(0).expand(copies, *one.shape).contiguous()


def graph_time_us(runs: list, reps: int = 20) -> float:
    """GPU time a call over the runs captured in one CUDA graph and replayed (after a warm, compiled call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for run in runs[:2]:
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (reps * len(runs)) * 1e3


def head(qtype: Q) -> tuple[float, float]:
    """(GB/s, relative error against the dequantized reference) of the output head's matvec."""
    raw = stored(qtype, 4096, D, VOCAB // 4096 + 1, 0).reshape(-1, quants.row_bytes(qtype, D))[:VOCAB].contiguous()
    x = torch.randn(1, D, device="cuda", dtype=DTYPE)
    got = matvec.matvec(raw, qtype, VOCAB, x).float()
    ref = x.float() @ quants.dequantize(raw[:4096], qtype, (4096, D)).T
    err = float((got[:, :4096] - ref).abs().max() / ref.abs().max())
    us = graph_time_us([lambda: matvec.matvec(raw, qtype, VOCAB, x)] * 20)
    return raw.nbytes / us / 1e3, err


def picked(qtype: Q) -> float:
    """GB/s of one token's K picked experts, gate + up + down and the weighted sum, K disjoint experts a call."""
    raws = [stored(qtype, FF, D, E, 1), stored(qtype, FF, D, E, 2), stored(qtype, D, FF, E, 3)]
    x = torch.randn(1, D, device="cuda", dtype=DTYPE)
    w = torch.softmax(torch.randn(1, K, device="cuda"), -1).to(DTYPE)
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0)).cuda()
    ids = [order[i * K : (i + 1) * K].view(1, K).contiguous() for i in range(E // K)]
    qtypes = (qtype, qtype, qtype)
    runs = [lambda i=i: moe_matvec.swiglu_picked(x, w, i, raws, qtypes, FF) for i in ids]
    us = graph_time_us(runs)
    nbytes = sum(r.nbytes for r in raws) // E * K
    return nbytes / us / 1e3


def main(names: list[str]) -> None:
    types = [Q[n.upper()] for n in names] or sorted(t for t in dots.DOTS if t in QUANTIZABLE)
    types = [Q.Q4_K] + [t for t in types if t != Q.Q4_K]
    print(f"{torch.cuda.get_device_name()}, x {DTYPE}; GB/s of stored bytes; ratio to Q4_K")
    print(f"{'type':<8} {'head GB/s':>10} {'ratio':>6} {'rel err':>8} {'8 experts GB/s':>15} {'ratio':>6}")
    base = None
    for t in types:
        h, err = head(t)
        p = picked(t)
        base = base or (h, p)
        print(f"{t.name:<8} {h:10.0f} {h / base[0]:6.2f} {err:8.1e} {p:15.0f} {p / base[1]:6.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
