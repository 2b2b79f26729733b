"""Each tensor type's decode kernels on qwen3-30b-a3b's shapes, in GB/s of stored bytes beside Q4_K's: the
matvec of one matrix (attn_q, 4096 x 2048), the down launch of a token's 8 picked experts (2048 x 768 each)
and the whole picked-expert layer (swiglu_picked: gate and up, down, the weighted sum; 8 of 128 experts).
Random bytes as weights (a kernel's speed does not depend on the values), CUDA-graph timing as
scripts/matvec_shapes.py times. The issue's bar: each type at least 80% of Q4_K's rate.

    python scripts/type_rates.py [TYPE ...]
"""

from __future__ import annotations

import sys

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from matvec_shapes import time_us  # scripts/ is on the path when run as a script

from moestream.formats.quants import row_bytes
from moestream.kernels import dots, moe_matvec
from moestream.kernels.matvec import matvec

D, F, E, K = 2048, 768, 128, 8  # hidden, expert width, experts, picks a token


def stored(qtype: Q, *shape: int) -> torch.Tensor:
    """Random bytes for a tensor of shape (numpy order) in qtype, on the GPU."""
    return torch.randint(0, 256, (*shape[:-1], row_bytes(qtype, shape[-1])), dtype=torch.uint8, device="cuda")


def rates(qtype: Q) -> dict[str, float]:
    """GB/s of stored bytes for each case."""
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    q = stored(qtype, 4096, D)
    stacks = [stored(qtype, E, F, D), stored(qtype, E, F, D), stored(qtype, E, D, F)]
    ids = torch.randperm(E, device="cuda")[:K].view(1, K)
    weights = torch.softmax(torch.randn(1, K, device="cuda"), -1).bfloat16()
    h = torch.randn(K, F, device="cuda", dtype=torch.bfloat16)
    picks = ids.view(-1)
    expert = [s[0].numel() for s in stacks]
    cases = {
        "q 4096x2048": (lambda: matvec(q, qtype, 4096, x), q.numel()),
        "down, 8 experts": (lambda: matvec(stacks[2], qtype, D, h, picks), K * expert[2]),
        "swiglu_picked": (
            lambda: moe_matvec.swiglu_picked(x, weights, ids, stacks, (qtype,) * 3, F),
            K * sum(expert),
        ),
    }
    return {name: nbytes / time_us(run) / 1e3 for name, (run, nbytes) in cases.items()}


def main(names: list[str]) -> None:
    qtypes = [Q[n] for n in names] if names else sorted(dots.DOTS)
    base = rates(Q.Q4_K)
    print(f"{'type':<8} {'bits/value':>10} " + " ".join(f"{c:>26}" for c in base))
    for qtype in qtypes:
        got = base if qtype == Q.Q4_K else rates(qtype)
        block, size = GGML_QUANT_SIZES[qtype]
        short = {c: "" if got[c] >= 0.8 * base[c] else " <0.8" for c in got}
        cells = [f"{got[c]:8.1f} GB/s {got[c] / base[c]:5.2f}x{short[c]}" for c in got]
        print(f"{qtype.name:<8} {8 * size / block:>10.2f} " + " ".join(f"{c:>26}" for c in cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
