"""The decode expert cache's hit rate against its size, replayed on a text's routing: each token is one decode
pass over every expert layer, through the engine's own ExpertCache (a cache of n experts per streamed layer,
scored by --cache-policy: static's refreshes on their schedule, lru's and lfu's admissions after each layer's
picks) holding one word per expert, on the CPU. A hit rate is a
property of the picks and the policy, so this measures what a GPU run's cache would, without one.

What it leaves out: the engine counts picks from the first decode step, so the prompt's picks (here: none, every
token is a decode step) do not seed static's set.
"""

from __future__ import annotations

import torch

from moestream.kernels.gather import first_picks
from moestream.offload.expert_cache import ExpertCache

GIB = 1 << 30
SIZES_GIB = (1, 2, 4, 8)  # the published LRU curve's cache sizes
FULL_GIB = 17.0  # qwen3-30b-a3b Q4_K_M's routed experts: a scaled file's sizes are these fractions of it


class _OneWord:
    """A layer's experts as one word each: ExpertCache's rows without the weights (hits need only the map)."""

    expert_bytes = 4

    def __init__(self, n_expert: int):
        self.n_expert = n_expert
        self.raw = torch.zeros((n_expert, self.expert_bytes), dtype=torch.uint8)

    def host_bytes(self) -> list[torch.Tensor]:
        return [self.raw]


def replay(picks: dict[int, torch.Tensor], n_expert: int, n: int, policy: str) -> tuple[float, float]:
    """A cache of n experts per layer, token after token over picks [T, K] per layer: the fraction of picks it
    held, and the experts its refreshes copied in per pick (link traffic besides the misses)."""
    if n <= 0:
        return 0.0, 0.0
    layers = sorted(picks)
    cache = ExpertCache(
        {il: _OneWord(n_expert) for il in layers},
        layers,
        min(n, n_expert),
        torch.device("cpu"),
        lambda raw, ids: raw[ids],
        policy,
    )
    hits = total = 0
    for t in range(picks[layers[0]].shape[0]):
        for il in layers:
            ids = picks[il][t]
            hits += ids.numel() - int(cache.uncached(il, ids))
            total += ids.numel()
            cache.counts(il).index_add_(0, ids, torch.ones_like(ids))
            cache.admit(il, ids, first_picks(ids), [cache.tensors[il].raw[ids]], torch.arange(ids.numel()))
        cache.end_pass()
    return hits / total, cache.moved / _OneWord.expert_bytes / total


def cache_sizes(total: int, n_expert: int) -> tuple[list[tuple[str, int]], str]:
    """(label, experts cached per layer) for each size, given the file's total routed expert bytes, and what the
    sizes are: GiB of the file's experts when it holds more than the largest size, else that GiB's fraction of
    FULL_GIB of all routed experts (a scaled or sliced file, whose GiB mean nothing)."""
    if total >= SIZES_GIB[-1] * GIB:
        rows = [(f"{g} GiB", g * GIB * n_expert // total) for g in SIZES_GIB]
        return rows, "GiB of the file's stored experts"
    rows = [(f"{g} GiB ({g / FULL_GIB:.1%})", round(g / FULL_GIB * n_expert)) for g in SIZES_GIB]
    return rows, f"fractions of all routed experts matching GiB of {FULL_GIB:g} GiB (qwen3-30b-a3b Q4_K_M)"


def cache_lines(picks: dict[int, torch.Tensor], n_expert: int, total: int, policies: tuple[str, ...]) -> list[str]:
    """info --routing's cache table: per size and policy, the hit rate and the experts read over the link per
    pick (the misses and the refreshes' copies), total: the file's routed expert bytes."""
    rows, what = cache_sizes(total, n_expert)
    lines = [
        f"expert cache: hit rate / experts over the link a pick (misses + refresh copies); a replay of the decode "
        f"picks; sizes as {what}"
    ]
    lines.append(f"  {'size':18s} {'experts/layer':>13s} " + " ".join(f"{p:>15s}" for p in policies))
    for label, n in rows:
        cells = []
        for p in policies:
            hit, copied = replay(picks, n_expert, n, p)
            cells.append(f"{100 * hit:6.1f}% / {100 * (1 - hit + copied):5.1f}%")
        lines.append(f"  {label:18s} {n:13d} " + " ".join(cells))
    return lines
