"""The compiled CPU matvec per tensor type: 8 experts' worth of rows (qwen3-30b-a3b's gate shape, 768 x 2048, out
of a stack of 32) with x in float32 and rounded to int8, in ms and GB/s of stored bytes, best of several runs.

    python scripts/cpu_dot_rates.py [--threads N] [--types Q4_K,Q6_K,...]
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
import torch
from cpu_experts import best  # scripts/ is on the path when run as a script
from gguf import GGMLQuantizationType as Q

from moestream.formats.quantize import quantize
from moestream.kernels import cpu_quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default=",".join(sorted(q.name for q in cpu_quant.INT8_TYPES)))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows, cols, stack = 768, 2048, 32
    w = (np.random.default_rng(0).standard_normal((stack, rows, cols)) * 0.05).astype(np.float32)
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(1))
    mats = torch.arange(0, stack, stack // 8)[:8]
    print(f"{a.threads} thread(s); ms for 8 matrices of {rows} x {cols}")
    print("| type | float x | int8 x | int8 GB/s |")
    print("|---|---:|---:|---:|")
    for name in a.types.split(","):
        qtype = Q[name]
        raw = torch.from_numpy(quantize(w, qtype))
        nbytes = 8 * raw[0].numel()
        dots = (partial(cpu_quant.matvec, raw, qtype, rows, x, mats, int8=int8) for int8 in (False, True))
        f, i = (1e3 * best(dot, 20) for dot in dots)
        print(f"| {name} | {f:.3f} | {i:.3f} | {nbytes / i / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
