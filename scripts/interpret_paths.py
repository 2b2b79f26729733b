"""The GPU-only branches on a machine without a GPU: Triton's interpreter runs the quantized matvecs (dense
projections, `ops/experts.py`'s matvec branch, the host gather before it) and the delta-net decode kernels
(qwen35moe) on the CPU device, and each
placement's greedy tokens must equal the plain CPU path's. Slow (minutes a placement): a check after changing
those branches, before device time is spent.

    pip install triton==3.6.0 && TRITON_INTERPRET=1 python scripts/interpret_paths.py MODEL [resident]   (a tiny Q4_K_M)
"""

from __future__ import annotations

import sys

import torch

import moestream
from moestream.kernels import deltanet_step, qmatvec

PROMPT = [(11 * t) % 1000 + 5 for t in range(12)]
PLACEMENTS = [
    {},
    dict(n_cpu_moe="all", small_batch="gather", prefetch=0),
    dict(n_cpu_moe="all", small_batch="gather", expert_cache=3),
    dict(n_cpu_moe="all", small_batch="upload"),
]


def greedy(e, n: int = 4):
    cache = e.new_cache()
    logits = e.forward(PROMPT, cache)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = e.forward([out[-1]], cache)
    return out, logits


if __name__ == "__main__":
    ref = moestream.load(sys.argv[1], device="cpu", progress=False)
    want, want_logits = greedy(ref)
    ref.close()
    qmatvec.usable = lambda qtype, device, n: qtype in qmatvec.DOTS and n <= qmatvec.MAX_TOKENS  # CPU too
    deltanet_step.usable = lambda qkv, *states: qkv.shape[0] == 1 and all(t.dtype == torch.float32 for t in states)
    for placement in PLACEMENTS[: 1 if "resident" in sys.argv[2:] else None]:
        e = moestream.load(sys.argv[1], device="cpu", progress=False, **placement)
        got, logits = greedy(e)
        e.close()
        err = float((logits - want_logits).abs().max() / want_logits.abs().max())
        print(f"{placement or 'resident'}: same tokens {got == want}, logits max relative difference {err:.1e}")
