"""Chrome trace event JSON of one or more timelines, for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process per schedule, one thread track per lane. Complete ("X") events on one track must nest
strictly or the viewers misdraw or drop them, so a span that partly overlaps another on its lane goes to an
extra track of that lane ("copy #2"). Times are rounded to whole nanoseconds before the overlap test, so
what is written nests exactly as tested.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from moestream.profiling.timeline import Span, ordered_lanes


def _pack(spans: list[tuple[int, int, Span]]) -> list[int]:
    """Track index (0 = the lane's own) for each (start_ns, end_ns, span), sorted by start, longest first."""
    stacks: list[list[int]] = []  # per track: end times of the slices still open
    tracks = []
    for a, b, _ in spans:
        for i, stack in enumerate(stacks):
            while stack and stack[-1] <= a:
                stack.pop()
            if not stack or b <= stack[-1]:
                stack.append(b)
                tracks.append(i)
                break
        else:
            stacks.append([b])
            tracks.append(len(stacks) - 1)
    return tracks


def _args(s: Span) -> dict:
    args = {k: v for k, v in (("layer", s.layer), ("slot", s.slot), ("ubatch", s.ubatch)) if v is not None}
    if s.nbytes:
        args["bytes"] = s.nbytes
        if s.duration > 0:
            args["GB/s"] = round(s.nbytes / s.duration / 1e9, 3)
    return args


def chrome_trace(runs: Mapping[str, list[Span]], process_name: str = "moestream") -> dict:
    """The trace as a dict: a process per run (named after process_name and the run), a thread per lane."""
    meta, events = [], []
    for pid, (run, spans) in enumerate(runs.items(), start=1):
        name = process_name if len(runs) == 1 and not run else f"{process_name} {run}".strip()
        meta += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
        tid = 0
        for lane in ordered_lanes(spans):
            timed = sorted(
                ((round(s.start * 1e9), round(s.end * 1e9), s) for s in spans if s.lane == lane),
                key=lambda t: (t[0], -t[1]),
            )
            tracks = _pack(timed)
            tids = []
            for k in range(max(tracks) + 1):
                tid += 1
                tids.append(tid)
                meta += [
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": lane if k == 0 else f"{lane} #{k + 1}"},
                    },
                    {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": pid,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    },
                ]
            events += [
                {
                    "name": s.name,
                    "cat": lane,
                    "ph": "X",
                    "pid": pid,
                    "tid": tids[k],
                    "ts": a / 1e3,
                    "dur": (b - a) / 1e3,
                    "args": _args(s),
                }
                for (a, b, s), k in zip(timed, tracks, strict=True)
            ]
    events.sort(key=lambda e: (e["ts"], -e["dur"]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    spans: list[Span] | Mapping[str, list[Span]], path: str | Path, process_name: str = "moestream"
) -> None:
    """Write spans (one run) or {schedule: spans} (one process each) as a Chrome trace JSON file."""
    runs = spans if isinstance(spans, Mapping) else {"": spans}
    Path(path).write_text(json.dumps(chrome_trace(runs, process_name)))
