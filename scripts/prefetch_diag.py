"""Next-layer prefetch on the GPU: the graphed decode step of a streamed placement (-ncmoe 26 spread, 12 GiB)
without a guess and with one (its width, the side stream's gather programs, where it is made and how many
streamed layers ahead, the experts the expert cache holds), side by side in one process, each checked to give
the unguessed run's greedy tokens.

    python scripts/prefetch_diag.py MODEL
"""

from __future__ import annotations

import sys

import torch
from decode_diag import step_ms  # scripts/ is on the path when this runs as a script

import moestream
from moestream.kernels import tuning
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
    variants = [  # experts a guess, gather programs and words a program, where the guess is made, layers ahead,
        # experts held a layer
        (8, 16, 2048, "streamed", 1, 0),
        (8, 16, 2048, "streamed", 1, "auto"),
        (8, 32, 2048, "streamed", 1, "auto"),
        (8, 64, 2048, "streamed", 1, "auto"),
        (8, 16, 8192, "streamed", 1, "auto"),
        (8, 32, 8192, "streamed", 1, "auto"),
        (8, 16, 2048, "streamed", 1, 8),
        (8, 16, 2048, "layer", 1, "auto"),
        (10, 16, 2048, "streamed", 1, "auto"),
        (8, 16, 2048, "streamed", 2, 0),
        (8, 16, 2048, "streamed", 2, "auto"),
    ]
    for width, programs, words, lead, ahead, held in variants:
        e.setup.reconfigure(prefetch=width, prefetch_ahead=ahead, expert_cache=held)
        prefetch.LEAD = lead
        with tuning.use(gather_programs=programs, gather_words=words):
            before = e.experts.counters.stats()
            ms = step_ms(e)
            d = [b - a for a, b in zip(before, e.experts.counters.stats(), strict=True)]
            same = greedy(e) == want
        print(
            f"prefetch {width:>2}, {programs:>3} programs of {4 * words // 1024:>2} KiB, "
            f"at the {lead:<8} {ahead} before, "
            f"{e.experts.cached_width:>3} held: {ms:7.3f} ms a step, {1 - d[1] / d[0]:.1%} guessed, "
            f"{d[4] / d[0]:.1%} held, "
            f"{(d[2] + d[3]) / 144 / 1e6:.1f} MB a step over the link, same tokens: {same}",
            flush=True,
        )
    e.close()
