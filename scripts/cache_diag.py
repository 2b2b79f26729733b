"""Where the expert cache's time goes (issue 10): the graphed decode step of -ncmoe 26 spread, 12 GiB, with
prefetch 8, side by side in one process: no cache; the cache refreshed on its schedule; filled once and never
refreshed; present but empty (the kernels' CACHED path, nothing held); and one refresh timed alone.

    python scripts/cache_diag.py MODEL
"""

from __future__ import annotations

import sys
import time

import torch
from decode_diag import step_ms  # scripts/ is on the path when this runs as a script
from prefetch_diag import greedy

import moestream
from moestream.offload.expert_cache import ExpertCache


def report(e, label: str, want: list[int]) -> None:
    before = e.experts.counters.stats()
    ms = step_ms(e)
    d = [b - a for a, b in zip(before, e.experts.counters.stats(), strict=True)]
    print(
        f"{label:<34} {ms:7.3f} ms a step, {1 - d[1] / d[0]:.1%} guessed, {d[4] / d[0]:.1%} held, "
        f"{(d[2] + d[3]) / 144 / 1e6:.1f} MB a step over the link, same tokens: {greedy(e) == want}",
        flush=True,
    )


if __name__ == "__main__":
    e = moestream.load(
        sys.argv[1], device="cuda", progress=False, n_cpu_moe=26, streamed_layers="spread", vram_budget="12GiB"
    )
    e.setup.reconfigure(expert_cache=0)
    want = greedy(e)
    report(e, "no cache", want)
    e.setup.reconfigure(expert_cache="auto")
    report(e, f"{e.experts.cached_width} held, refreshed", want)
    cache = e.experts.prefetcher.cache
    torch.cuda.synchronize()
    for _ in range(3):
        cache.freq.random_(0, 100)
        start = time.perf_counter()
        cache.refresh()
        torch.cuda.synchronize()
        print(f"one refresh after random counts: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
    end_pass = ExpertCache.end_pass
    ExpertCache.end_pass = lambda self: None  # filled, never refreshed
    report(e, f"{cache.n} held, never refreshed", want)
    cache.slot_of.fill_(-1)
    report(e, "cache present, holding nothing", want)
    ExpertCache.end_pass = end_pass
    e.close()
