"""Next-layer prefetch on the GPU: the graphed decode step of a streamed placement (-ncmoe 26 spread, 12 GiB)
without a guess and with one, the side stream's gather on several program counts, side by side in one
process, each checked to give the unguessed run's greedy tokens.

    python scripts/prefetch_diag.py MODEL
"""

from __future__ import annotations

import sys

import torch
from decode_diag import step_ms  # scripts/ is on the path when this runs as a script

import moestream
from moestream.offload import prefetch


def greedy(engine, n: int = 24) -> list[int]:
    cache = engine.new_cache()
    logits = engine.forward(list(range(1, 17)), cache)
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits[-1])))
        logits = engine.forward([out[-1]], cache)
    return out


if __name__ == "__main__":
    e = moestream.load(
        sys.argv[1],
        device="cuda",
        progress=False,
        n_cpu_moe=26,
        streamed_layers="spread",
        vram_budget="12GiB",
        prefetch=0,
    )
    want = greedy(e)
    print(f"prefetch off                {step_ms(e):7.3f} ms a step", flush=True)
    for width in (e.spec.n_expert_used, e.spec.n_expert_used + 2):
        e.reconfigure(prefetch=width)
        for programs in (8, 16, 32, 64, 132, None):
            prefetch.PROGRAMS = programs
            before = e.model.experts.prefetch_stats()
            ms = step_ms(e)
            picks, misses, _ = (b - a for a, b in zip(before, e.model.experts.prefetch_stats(), strict=True))
            same = greedy(e) == want
            print(
                f"prefetch {width:>2}, {str(programs):>4} programs {ms:7.3f} ms a step, {1 - misses / picks:.1%} "
                f"guessed, same tokens: {same}",
                flush=True,
            )
    e.close()
