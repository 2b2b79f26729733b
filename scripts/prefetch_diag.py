"""Next-layer prefetch on the GPU: the graphed decode step of a streamed placement (-ncmoe 26 spread, 12 GiB)
without a guess and with one (its width, the side stream's gather programs, where it is made), side by side
in one process, each checked to give the unguessed run's greedy tokens.

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
    variants = [(8, 16, "layer"), (8, 32, "layer"), (8, 16, "streamed"), (8, 32, "streamed"), (10, 32, "streamed")]
    for width, programs, lead in variants:  # experts a guess, gather programs, where the guess is made
        e.reconfigure(prefetch=width)
        prefetch.PROGRAMS, prefetch.LEAD = programs, lead
        before = e.model.experts.prefetch_stats()
        ms = step_ms(e)
        picks, misses, _ = (b - a for a, b in zip(before, e.model.experts.prefetch_stats(), strict=True))
        same = greedy(e) == want
        print(
            f"prefetch {width:>2}, {programs:>3} programs, at the {lead:<8} before {ms:7.3f} ms a step, "
            f"{1 - misses / picks:.1%} guessed, same tokens: {same}",
            flush=True,
        )
    e.close()
