"""What one `bench` run measures, in a module without torch: the CLI checks every row's options before the slow
imports."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sweep:
    """What one bench run measures: every combination of the lists, each test `repeats` times."""

    prompts: list[int]  # ppN tests (0: none)
    gens: list[int]  # tgN tests (0: none)
    ubatches: list[int]
    n_cpu_moes: list[int | str]
    streams: list[str]
    slots: list[int]
    picks: list[str]  # --streamed-layers first | spread
    prefetches: list[int | None] = field(default_factory=lambda: [None])  # --prefetch (None: the router's count)
    aheads: list[int] = field(default_factory=lambda: [1])  # --prefetch-ahead
    cpu_layers: list[int] = field(default_factory=lambda: [0])  # --cpu-layers
    caches: list[int | str] = field(default_factory=lambda: ["auto"])  # --expert-cache
    depths: list[int] = field(default_factory=lambda: [0])  # -d: tokens of context before each test (untimed)
    types_k: list[str] = field(default_factory=lambda: ["auto"])  # -ctk
    types_v: list[str] = field(default_factory=lambda: ["auto"])  # -ctv
    repeats: int = 3
    floors: bool = True  # also time each test with every expert resident (the compute floor)
    text: str | None = None  # --text: the tests run this file's tokens (None: random token ids)

    def placements(self) -> list[dict]:
        """Each row's engine options, in order (what run_bench reconfigures to; the CLI checks them first)."""
        columns = {
            "ubatch": self.ubatches,
            "n_cpu_moe": self.n_cpu_moes,
            "streamed_layers": self.picks,
            "stream": self.streams,
            "slots": self.slots,
            "prefetch": self.prefetches,
            "prefetch_ahead": self.aheads,
            "cpu_layers": self.cpu_layers,
            "expert_cache": self.caches,
            "cache_type_k": self.types_k,
            "cache_type_v": self.types_v,
        }
        return [dict(zip(columns, combo, strict=True)) for combo in itertools.product(*columns.values())]
