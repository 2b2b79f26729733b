"""Where the time of a pass went, computed from its timeline: idle compute, link speed, overlap, stalls.

Compute busy time is the union of the "compute" lane (nested spans such as a dequant inside experts count
once); copy busy time is the union of the "copy" lane.

A stall is a gap in compute, followed by more compute, inside which an upload finished (on the copy lane or a
CPU copy thread that stages it): compute resumed once the bytes were there. Its waiting time is the part of
the gap from its start to the last upload that finished in it during which an upload was in flight. Gaps
with no upload finishing in them (launch overhead, host work) are idle time but not waiting on uploads.

Waiting on the host is the part of a compute gap before the host had even queued the work that ends it (CUDA
stamps carry the host clock of their queuing): the GPU had run dry and waited for Python to launch more.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from moestream.profiling.timeline import Span

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """Intersection of two unions (sorted, disjoint interval lists)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy: list[Interval], start: float, end: float | None = None) -> list[Interval]:
    """The idle stretches of a lane from start (to end, if given) around its busy union."""
    out, t = [], start
    for a, b in busy:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if end is not None and end > t:
        out.append((t, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _is_upload_lane(lane: str) -> bool:
    return lane == "copy" or lane.startswith("cpu-copy")


@dataclass(frozen=True)
class Stall:
    """Compute idle from start to end before `layer`'s compute, of which upload_s waiting on uploads."""

    start: float
    end: float
    layer: int | None
    upload_s: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class LayerStats:
    """One layer over all micro-batches: compute (and per op), uploads, and the wait on uploads before it."""

    layer: int
    compute_s: float = 0.0
    by_name: dict[str, float] = field(default_factory=dict)
    copy_s: float = 0.0
    nbytes: int = 0
    wait_s: float = 0.0


@dataclass
class Summary:
    """One pass in numbers (seconds, bytes, GB = 1e9 bytes); None where there were no copies to measure."""

    wall_s: float
    compute_busy_s: float
    idle_s: float
    idle_pct: float
    copy_busy_s: float
    bytes_copied: int
    copy_gbps: float | None  # GB/s while copying (bytes over copy busy time)
    avg_gbps: float | None  # GB/s over the pass (bytes over wall time)
    hidden_copy_s: float  # copy time under compute
    overlap_pct: float | None  # hidden copy time over copy time
    wait_on_upload_s: float
    wait_on_host_s: float | None  # None where host and device are one (CPU device)
    stalls: list[Stall]  # longest first
    layers: list[LayerStats]
    lane_busy_s: dict[str, float]
    compute_by_name: dict[str, float]

    def as_dict(self) -> dict:
        d = asdict(self)
        for stall, s in zip(d["stalls"], self.stalls, strict=True):
            stall["duration"] = s.duration
        return d

    def table(self, top: int = 5, per_layer: bool = True) -> str:
        """Plain-text report: totals, the `top` longest stalls and (optionally) one row per layer."""

        def ms(s: float) -> str:
            return f"{s * 1e3:9.2f} ms"

        def opt(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        lines = [
            f"wall               {ms(self.wall_s)}",
            f"compute busy       {ms(self.compute_busy_s)}",
            f"compute idle       {ms(self.idle_s)}  ({self.idle_pct:.1f} %)",
            f"waiting on upload  {ms(self.wait_on_upload_s)}",
            f"waiting on host    {'        -' if self.wait_on_host_s is None else ms(self.wait_on_host_s)}"
            "  (work not yet queued by the host)",
            f"copy busy          {ms(self.copy_busy_s)}  ({self.bytes_copied / 2**30:.3f} GiB)",
            f"link while copying {opt(self.copy_gbps, '9.2f')} GB/s",
            f"link over the pass {opt(self.avg_gbps, '9.2f')} GB/s",
            f"overlap            {opt(self.overlap_pct, '9.1f')} %  of copy time hidden under compute",
        ]
        if self.compute_by_name:
            ops = sorted(self.compute_by_name.items(), key=lambda x: -x[1])
            own = ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in ops)
            lines.append(f"compute by op      {own} (each op's own time: they add up to compute busy)")
        if self.stalls:
            lines += [
                "",
                f"top stalls ({len(self.stalls)} in all)",
                f"{'at ms':>10} {'idle ms':>10} {'upload ms':>10} {'before layer':>13}",
            ]
            lines += [
                f"{s.start * 1e3:10.2f} {s.duration * 1e3:10.2f} {s.upload_s * 1e3:10.2f} "
                f"{'-' if s.layer is None else s.layer:>13}"
                for s in self.stalls[:top]
            ]
        if per_layer and self.layers:
            names = sorted({n for ls in self.layers for n in ls.by_name})
            lines += [
                "",
                " ".join(
                    [
                        f"{'layer':>5}",
                        f"{'compute ms':>10}",
                        *(f"{n[:10]:>10}" for n in names),
                        f"{'copy ms':>10}",
                        f"{'MiB':>8}",
                        f"{'wait ms':>10}",
                    ]
                ),
            ]
            lines += [
                " ".join(
                    [
                        f"{ls.layer:>5}",
                        f"{ls.compute_s * 1e3:10.2f}",
                        *(f"{ls.by_name.get(n, 0.0) * 1e3:10.2f}" for n in names),
                        f"{ls.copy_s * 1e3:10.2f}",
                        f"{ls.nbytes / 2**20:8.1f}",
                        f"{ls.wait_s * 1e3:10.2f}",
                    ]
                )
                for ls in self.layers
            ]
        return "\n".join(lines)


def _stalls(spans: list[Span], compute: list[Interval]) -> list[Stall]:
    """Gaps before stretches of compute (from the pass start) in which an upload finished; longest first."""
    # start of a compute stretch -> layer of the (longest) compute span that begins it
    first_layer: dict[float, int | None] = {}
    for s in sorted(spans, key=lambda s: -s.duration):
        if s.lane == "compute":
            first_layer.setdefault(s.start, s.layer)
    upload_spans = [(s.start, s.end) for s in spans if _is_upload_lane(s.lane)]
    uploads, ends = union(upload_spans), sorted(b for _, b in upload_spans)
    stalls = []
    for idle_from, a in gaps(compute, min(s.start for s in spans)):
        i, j = bisect_right(ends, idle_from), bisect_right(ends, a)
        if j > i:
            waited = total(intersect([(idle_from, ends[j - 1])], uploads))
            stalls.append(Stall(idle_from, a, first_layer.get(a), waited))
    return sorted(stalls, key=lambda s: -s.duration)


def _wait_on_host(spans: list[Span], compute: list[Interval]) -> float | None:
    """Sum over compute gaps of the time before the host queued the work that ends the gap."""
    queued: dict[float, float] = {}  # start of a compute stretch -> when the host queued its first work
    for s in spans:
        if s.lane == "compute" and s.queued is not None:
            queued[s.start] = min(queued.get(s.start, s.queued), s.queued)
    if not queued:
        return None
    waited = 0.0
    for idle_from, a in gaps(compute, min(s.start for s in spans)):
        if a in queued:
            waited += max(0.0, min(a, queued[a]) - idle_from)
    return waited


def _own_time(spans: list[Span]) -> dict[int, float]:
    """Each compute span's duration less the spans nested in it (a stack's dequantization inside its experts'
    span): by op, the times add up to the busy time instead of counting nested work twice."""
    own: dict[int, float] = {}
    stack: list[Span] = []
    for s in sorted((s for s in spans if s.lane == "compute"), key=lambda s: (s.start, -s.end)):
        while stack and stack[-1].end <= s.start:
            stack.pop()
        if stack and s.end <= stack[-1].end:
            own[id(stack[-1])] -= s.duration
        own[id(s)] = s.duration
        stack.append(s)
    return own


def summarize(spans: list[Span], wall_s: float | None = None) -> Summary:
    """The numbers of one pass. wall_s: the measured wall time, if longer than the spans' extent."""
    if spans:
        extent = max(s.end for s in spans) - min(s.start for s in spans)
        wall = max(extent, wall_s or 0.0)
    else:
        wall = wall_s or 0.0
    by_lane: dict[str, list[Interval]] = defaultdict(list)
    for s in spans:
        by_lane[s.lane].append((s.start, s.end))
    lanes = {lane: union(iv) for lane, iv in by_lane.items()}
    compute, copy = lanes.get("compute", []), lanes.get("copy", [])

    busy, copy_s = total(compute), total(copy)
    hidden = total(intersect(copy, compute))
    nbytes = sum(s.nbytes for s in spans if s.lane == "copy")
    stalls = _stalls(spans, compute) if compute else []

    compute_by_name: dict[str, float] = defaultdict(float)
    layers: dict[int, LayerStats] = {}
    per_layer: dict[tuple[int, str], list[Interval]] = defaultdict(list)
    own = _own_time(spans)
    for s in spans:
        if s.lane == "compute":
            compute_by_name[s.name] += own[id(s)]
        if s.layer is None or s.lane not in ("compute", "copy"):
            continue
        ls = layers.setdefault(s.layer, LayerStats(s.layer))
        per_layer[s.layer, s.lane].append((s.start, s.end))
        if s.lane == "compute":
            ls.by_name[s.name] = ls.by_name.get(s.name, 0.0) + own[id(s)]
        else:
            ls.nbytes += s.nbytes
    for (layer, lane), iv in per_layer.items():
        if lane == "compute":
            layers[layer].compute_s = total(union(iv))
        else:
            layers[layer].copy_s = total(union(iv))
    for st in stalls:
        if st.layer in layers:
            layers[st.layer].wait_s += st.upload_s

    return Summary(
        wall_s=wall,
        compute_busy_s=busy,
        idle_s=wall - busy,
        idle_pct=100 * (wall - busy) / wall if wall > 0 else 0.0,
        copy_busy_s=copy_s,
        bytes_copied=nbytes,
        copy_gbps=nbytes / copy_s / 1e9 if copy_s > 0 else None,
        avg_gbps=nbytes / wall / 1e9 if wall > 0 else None,
        hidden_copy_s=hidden,
        overlap_pct=100 * hidden / copy_s if copy_s > 0 else None,
        wait_on_upload_s=sum(st.upload_s for st in stalls),
        wait_on_host_s=_wait_on_host(spans, compute) if compute else None,
        stalls=stalls,
        layers=sorted(layers.values(), key=lambda ls: ls.layer),
        lane_busy_s={lane: total(iv) for lane, iv in lanes.items()},
        compute_by_name=dict(compute_by_name),
    )
