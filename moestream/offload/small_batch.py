"""How a streamed layer serves a micro-batch of a few tokens: the one decode policy.

Below --stream-min-batch tokens a streamed layer does not upload whole: it gathers the picked experts with a
kernel reading the page-locked map (no sync), uploads just those (a sync to learn which), or computes them on
the CPU straight from the map. Gathered layers may guess the next layer's experts ahead (--prefetch) and keep
the most picked on the GPU (--expert-cache). `decode_plan` turns the options and what the machine allows
(`Access`) into a frozen `DecodePlan` the builder consumes; --small-batch auto is its rule, or, where the
choice is worth measuring (which way is fastest depends on the link and the CPU), what `measure` timed
fastest. `Timings` is the one timing helper: auto's and the server's batched-or-alone choice
(serving/scheduler.py) both pick the way timed fastest with it.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moestream.options import SmallBatch

if TYPE_CHECKING:  # the CLI reads SmallBatch: this module stays light (no torch)
    from moestream.options import Options

ON_CPU_DEVICE = False  # measure on the CPU device too (tests, with injected delays): there the rule stands,
# every way reading the same RAM
WARM_UP = 2  # untimed steps a way: the first compiles kernels and captures the step's graph
STEPS = 4  # timed steps a way (their median counts)
OUT_OF_RACE = 3.0  # a way whose first timed step takes this many times the best cost so far stops there


def evenly_spaced(items: list[int], n: int) -> list[int]:
    """n of items (at most all), evenly spaced: each the middle of its share. --streamed-layers spread picks
    the streamed layers so, and --cpu-layers the CPU's among them."""
    n, m = min(n, len(items)), len(items)
    return [items[int((i + 0.5) * m / n)] for i in range(n)]


@dataclass(frozen=True)
class Access:
    """What the machine and a placement let small batches do."""

    on_gpu: bool  # the compute device is a GPU
    readable: bool  # the streamed experts lie where a kernel there can read them (page-locked, or the CPU's RAM)
    kernel_ok: bool  # the gather kernel may read host memory (Triton present, no failure so far)
    sharded: bool  # experts split over several --devices: no device holds a whole layer to upload into
    streams: bool = True  # some layer's experts stream (before the placement is made: assumed)

    @property
    def can_gather(self) -> bool:
        """A kernel on the compute device reads the streamed experts where they lie."""
        return self.readable and (not self.on_gpu or self.kernel_ok)


def rule(access: Access) -> SmallBatch:
    """auto unmeasured: gather on a GPU whose kernels read the page-locked experts, else upload; across
    several --devices, where no device holds a whole layer to upload into, gather where readable, else cpu."""
    if access.on_gpu and access.readable and access.kernel_ok:
        return SmallBatch.GATHER
    if access.sharded:
        return SmallBatch.GATHER if access.readable else SmallBatch.CPU
    return SmallBatch.UPLOAD


@dataclass(frozen=True)
class Measured:
    """What auto chose, a decode step's seconds under each way it tried, and what choosing cost at load:
    the measuring (compiles and captures included) and the rebuild of the placement for the chosen way."""

    chosen: SmallBatch
    seconds: dict[SmallBatch, float]
    measuring: float = 0.0
    rebuilding: float = 0.0
    note: str = ""  # where the choice came from when it was not timed now (runtime/way_memory.py)

    def describe(self) -> str:
        tried = ", ".join(f"{way} {s * 1e3:.1f}" for way, s in self.seconds.items())
        cost = self.note or f"{self.measuring:.1f} s measuring"
        return (
            f"small batches: {self.chosen} (auto, measured ms a decode step: {tried}; "
            f"{cost}, {self.rebuilding:.1f} s rebuilding the placement)"
        )


@dataclass(frozen=True)
class DecodePlan:
    """How this placement's streamed layers serve micro-batches under min_batch tokens. Built before the
    placement (to budget the guesses' ring, access as expected) and again once page-locking is done."""

    asked: SmallBatch  # --small-batch as given
    way: SmallBatch  # what runs (never auto)
    access: Access
    min_batch: int  # --stream-min-batch: smaller micro-batches take `way`
    n_guess: int  # experts of a gathered layer guessed a layer ahead (--prefetch; 0: off)
    expert_cache: int | str  # --expert-cache as asked (the count comes from the budget the placement leaves)
    measured: Measured | None = None  # what auto timed to choose `way`
    cache_policy: str = "lru"  # --cache-policy: which experts that cache holds
    ahead: int = 1  # --prefetch-ahead: streamed layers between a guess and the layer it guesses
    cpu_layers: int = 0  # --cpu-layers: streamed layers whose small batches compute on the CPU whatever `way` is

    def on_cpu(self, streamed: list[int]) -> frozenset[int]:
        """Which of the streamed layers (in order) compute their small batches on the CPU: all under the cpu
        way, else cpu_layers of them evenly spaced (so the gathered ones between have time to prefetch)."""
        return frozenset(streamed if self.way is SmallBatch.CPU else evenly_spaced(streamed, self.cpu_layers))

    @property
    def gathers(self) -> bool:
        """Small batches gather their experts with a kernel reading host memory (or index it, on the CPU)."""
        return self.way is SmallBatch.GATHER and self.access.can_gather

    @property
    def guesses(self) -> bool:
        """One-token steps gather the next streamed layer's guessed experts ahead (a ring of them)."""
        return self.gathers and self.n_guess > 0 and self.access.streams

    def trying(self, way: SmallBatch) -> DecodePlan:
        """This plan with small batches served `way` (what auto measures)."""
        return replace(self, way=way)

    def measures(self) -> bool:
        """Whether auto has a choice worth timing: one-token steps of streamed layers take a small-batch way
        and more than one way is open (on a GPU; on the CPU device the rule stands unless ON_CPU_DEVICE)."""
        a = self.access
        return (
            self.asked is SmallBatch.AUTO
            and self.measured is None
            and (a.on_gpu or ON_CPU_DEVICE)
            and a.streams
            and self.min_batch > 1
        )

    def warn(self) -> None:
        """Say where the plan cannot do what was asked: gather from experts no kernel reads, or hold experts
        for guesses that are not made."""
        if not self.access.streams:
            return
        if self.way is SmallBatch.GATHER and not self.access.readable:
            warnings.warn(
                "--small-batch gather needs the streamed experts page-locked (not --stream serial, and "
                "page-locking must succeed); small batches upload their experts instead",
                stacklevel=3,
            )
        if self.expert_cache not in ("auto", 0) and not self.guesses:
            warnings.warn(
                f"--expert-cache {self.expert_cache}: the cache serves decode's guessed gathers, which need "
                "--small-batch gather (or auto on a GPU), streamed experts page-locked and --prefetch above 0; "
                "no experts are held",
                stacklevel=3,
            )


def decode_plan(opts: Options, n_expert_used: int, access: Access, measured: Measured | None = None) -> DecodePlan:
    """The plan for opts on this access: the way asked, or for auto what was measured fastest, else the rule."""
    asked = opts.decode.small_batch
    if asked is not SmallBatch.AUTO:
        way = asked
    else:
        way = measured.chosen if measured is not None else rule(access)
    n_guess = n_expert_used if opts.decode.prefetch is None else opts.decode.prefetch
    d = opts.decode
    return DecodePlan(
        asked,
        way,
        access,
        opts.streaming.stream_min_batch,
        n_guess,
        d.expert_cache,
        measured,
        d.cache_policy,
        d.prefetch_ahead,
        d.cpu_layers,
    )


def ways(access: Access, cpu_dots: bool) -> list[SmallBatch]:
    """The ways a placement's streamed layers can serve a small batch. cpu_dots: the C matvec computes every
    streamed type (torch's dequantizing fallback is no contender)."""
    out = []
    if access.can_gather:
        out.append(SmallBatch.GATHER)
    if not access.sharded:  # across --devices no device holds a layer to upload into
        out.append(SmallBatch.UPLOAD)
    if cpu_dots:
        out.append(SmallBatch.CPU)
    return out


Trial = Callable[[SmallBatch], AbstractContextManager[Callable[[], object]]]  # way -> a step to time, while open


def measure(tried: list[SmallBatch], trial: Trial) -> Measured:
    """Time WARM_UP + STEPS decode steps under each way (trial(way) opens a placement serving that way and
    yields one step); the fastest median is chosen. One way serves every streamed layer: a step that mixes
    them cannot replay as one CUDA graph (upload and cpu wait on the host), which would cost more than any
    per-layer difference gains (the streamed layers of one model have the same shapes). A way far behind after
    its first timed step is not timed further (the cpu way's steps took 35 times gather's: 2 s of a load)."""
    start, timings = time.perf_counter(), Timings(warm_up=WARM_UP, window=STEPS)
    best = float("inf")
    for way in tried:
        with trial(way) as step:
            for i in range(WARM_UP + STEPS):
                timings.time(way, step)
                if i == WARM_UP and timings.cost(way) > OUT_OF_RACE * best:
                    break
        best = min(best, timings.cost(way))
    return Measured(timings.fastest(tried), {w: timings.cost(w) for w in tried}, time.perf_counter() - start)


class Timings:
    """Seconds each way took to run, per way: the first warm_up runs of a way are not counted (they compile
    kernels and capture graphs); its cost is the median of its last `window` counted runs."""

    def __init__(self, warm_up: int, window: int):
        self.warm_up, self.window = warm_up, window
        self._runs: dict[Hashable, int] = {}
        self._seconds: dict[Hashable, deque[float]] = {}

    def time(self, way: Hashable, run: Callable[[], object]) -> None:
        """Run once and record its seconds (run waits for the device: it reads a result back)."""
        start = time.perf_counter()
        run()
        self.record(way, time.perf_counter() - start)

    def record(self, way: Hashable, seconds: float) -> None:
        self._runs[way] = self._runs.get(way, 0) + 1
        if self._runs[way] > self.warm_up:
            self._seconds.setdefault(way, deque(maxlen=self.window)).append(seconds)

    def failed(self, way: Hashable) -> None:
        """A run this way failed: it counts as warm and infinitely slow until it runs again."""
        self._runs[way] = max(self.warm_up + 1, self._runs.get(way, 0))
        self._seconds[way] = deque([float("inf")], maxlen=self.window)

    def runs(self, way: Hashable) -> int:
        return self._runs.get(way, 0)

    def cost(self, way: Hashable) -> float:
        """Seconds a run of way: the median of its last counted runs (infinite before any)."""
        seconds = self._seconds.get(way)
        return statistics.median(seconds) if seconds else float("inf")

    def costs(self) -> dict[Hashable, float]:
        """Each way's cost, for the ways with counted runs."""
        return {way: self.cost(way) for way in self._seconds}

    def fastest(self, ways: list[Hashable]) -> Hashable:
        """The way of least cost (the first of equals)."""
        return min(ways, key=self.cost)
