"""A timeline of uploads and compute per layer, stamped with device events and resolved once at the end.

Recording must not change what it measures: on CUDA a stamp is a timing event recorded on a stream (no host
sync), on the CPU device it is a clock read. Nothing is converted to seconds until `resolve()`, which runs
once after the pass and synchronises once.

Callers take `timeline: Timeline = NULL` and call `stamp`/`add`/`span` unconditionally: with profiling off
these are no-op calls that create no events and allocate nothing. Building costly arguments (e.g. summing
byte counts) can be guarded with `if timeline.enabled:`.

Lanes the engine uses: "copy" (uploads to the device, also when a serial schedule queues them on the compute
stream), "compute" (names "attention", "router", "dequant", "experts", "head", ...) and one "cpu-copy-N" per
host thread that stages bytes for the uploads (host clock stamps, also on CUDA: see `host_stamp`).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaStamp:
    """A timing event on a stream, and the host clock when the host queued it."""

    event: torch.cuda.Event
    queued: float


Stamp = CudaStamp | float
"""A point in time as recorded: a CUDA stamp (not yet resolved) or a `time.perf_counter()` reading."""


@dataclass(frozen=True)
class Span:
    """One interval of one lane, in seconds from the timeline's first stamp."""

    lane: str
    name: str
    start: float
    end: float
    layer: int | None = None
    nbytes: int = 0
    slot: int | None = None
    ubatch: int | None = None
    queued: float | None = None  # when the host queued the start (CUDA; None where host and device are one)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Collects stamped spans during a run; `resolve()` turns them into `Span`s afterwards.

    Create it right before the pass: on CUDA the constructor synchronises once to tie event times to the
    host clock, so that host stamps (CPU copy threads) and device events share one time axis.
    `add` may be called from any thread (list.append is atomic); `resolve` only after those threads are done.
    """

    enabled = True

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._raw: list[tuple[str, str, Stamp, Stamp, int | None, int, int | None, int | None]] = []
        self.origin: float | None = None  # host perf_counter() of t=0, set by resolve()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self._anchor = torch.cuda.Event(enable_timing=True)
            before = time.perf_counter()
            self._anchor.record(torch.cuda.current_stream(self.device))
            self._anchor.synchronize()
            self._anchor_host = (before + time.perf_counter()) / 2

    def stamp(self, stream: torch.cuda.Stream | None = None) -> Stamp:
        """Now, on `stream` (default: current stream): an event on CUDA, a clock read on the CPU device."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return CudaStamp(event, time.perf_counter())

    def host_stamp(self) -> Stamp:
        """Now on the host clock, for lanes that are host threads (CPU copy threads) even on CUDA."""
        return time.perf_counter()

    def add(
        self,
        lane: str,
        name: str,
        start: Stamp,
        end: Stamp,
        layer: int | None = None,
        nbytes: int = 0,
        slot: int | None = None,
        ubatch: int | None = None,
    ) -> None:
        """Record that `name` ran on `lane` from `start` to `end` (stamps from `stamp` or `host_stamp`)."""
        self._raw.append((lane, name, start, end, layer, nbytes, slot, ubatch))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, stream: torch.cuda.Stream | None = None, **fields) -> Iterator[None]:
        """`with timeline.span("compute", "attention", layer=il):` stamps around the block."""
        start = self.stamp(stream)
        yield
        self.add(lane, name, start, self.stamp(stream), **fields)

    def resolve(self) -> list[Span]:
        """All spans in seconds from the earliest start, sorted by start. Synchronises once on CUDA."""
        if self._cuda and self._raw:
            torch.cuda.synchronize(self.device)
        rows = [
            (lane, name, self._seconds(a), self._seconds(b), a.queued if isinstance(a, CudaStamp) else None, *rest)
            for lane, name, a, b, *rest in self._raw
        ]
        if not rows:
            return []
        t0 = self.origin = min(r[2] for r in rows)
        spans = [
            Span(lane, name, a - t0, b - t0, *rest, queued=None if q is None else q - t0)
            for lane, name, a, b, q, *rest in rows
        ]
        return sorted(spans, key=lambda s: (s.start, -s.end, s.lane))

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp
        return self._anchor_host + self._anchor.elapsed_time(stamp.event) / 1e3


class NullTimeline(Timeline):
    """Profiling off: every call is a no-op that creates no event and allocates nothing."""

    enabled = False

    def __init__(self):
        self.origin = None

    def stamp(self, stream: torch.cuda.Stream | None = None) -> Stamp:
        return 0.0

    def host_stamp(self) -> Stamp:
        return 0.0

    def add(self, *args, **fields) -> None:
        pass

    def span(
        self, lane: str, name: str, stream: torch.cuda.Stream | None = None, **fields
    ) -> contextlib.AbstractContextManager[None]:
        return _NO_SPAN

    def resolve(self) -> list[Span]:
        return []


_NO_SPAN = contextlib.nullcontext()
NULL = NullTimeline()


def ordered_lanes(spans: Iterable[Span]) -> list[str]:
    """Lanes in display order: copy, compute, then CPU copy threads by number, then anything else by name."""

    def key(lane: str) -> tuple:
        if lane == "copy":
            return (0,)
        if lane == "compute":
            return (1,)
        if m := re.fullmatch(r"cpu-copy-(\d+)", lane):
            return (2, int(m.group(1)))
        return (3, lane)

    return sorted({s.lane for s in spans}, key=key)
