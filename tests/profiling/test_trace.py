"""Outputs of a timeline: the Chrome trace (what Perfetto and chrome://tracing load) and the PNG timeline.

The trace is checked against the rules of Perfetto's JSON importer (every X event with ts, dur, pid,
tid; named processes and threads; strictly nested slices per thread) and, where a trace_processor_shell
binary is at hand, loaded by Perfetto's own trace processor. The perfetto package downloads that binary on
first use, which a machine without internet cannot do: point PERFETTO_TRACE_PROCESSOR at one (or have it
cached where the package keeps it) to run that test.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from moestream.profiling.plot import plot_timelines
from moestream.profiling.stats import summarize
from moestream.profiling.timeline import Span, Timeline
from moestream.profiling.trace import write_chrome_trace

N_LAYERS, NBYTES = 6, 50_000_000


def run_pass(overlap: bool, copy_s: float = 0.02, compute_s: float = 0.03) -> tuple[list[Span], float]:
    """A pass with host staging, an upload and compute per layer; its spans and the measured wall time.

    Overlapped, the staging and upload of the next layer run while the current one computes.
    """
    t_begin = time.perf_counter()
    tl = Timeline(torch.device("cpu"))
    ready = [threading.Event() for _ in range(N_LAYERS)]

    def upload(il: int) -> None:
        t0 = tl.host_stamp()
        time.sleep(copy_s / 2)
        t1 = tl.host_stamp()
        tl.add("cpu-copy-0", "stage", t0, t1, layer=il)
        time.sleep(copy_s / 2)
        tl.add("copy", "upload", t1, tl.stamp(), layer=il, nbytes=NBYTES, slot=il % 2)
        ready[il].set()

    def compute(il: int) -> None:
        for name, share in (("attention", 0.3), ("router", 0.1), ("experts", 0.6)):
            with tl.span("compute", name, layer=il):
                time.sleep(share * compute_s)

    if overlap:
        thread = threading.Thread(target=lambda: [upload(il) for il in range(N_LAYERS)])
        thread.start()
        for il in range(N_LAYERS):
            ready[il].wait()
            compute(il)
        thread.join()
    else:
        for il in range(N_LAYERS):
            upload(il)
            compute(il)
    spans = tl.resolve()
    return spans, time.perf_counter() - t_begin


def check_chrome_trace(doc: dict) -> dict[tuple[int, int], list[dict]]:
    """Assert the rules Perfetto's JSON importer relies on; return the X events per (pid, tid)."""
    assert set(doc) >= {"traceEvents"}
    names: dict[tuple[str, int, int], str] = {}
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in doc["traceEvents"]:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            assert isinstance(e["args"], dict) and e["args"]
            tid = e["tid"] if e["name"].startswith("thread") else 0
            names[e["name"], e["pid"], tid] = e["args"].get("name")
        else:
            assert e["ph"] == "X" and isinstance(e["name"], str) and isinstance(e["args"], dict)
            assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float) and e["dur"] >= 0
            tracks[e["pid"], e["tid"]].append(e)
    for pid, tid in tracks:
        assert names.get(("process_name", pid, 0)) and names.get(("thread_name", pid, tid))
    # slices on one thread nest strictly, in whole nanoseconds as Perfetto reads them
    for events in tracks.values():
        open_ends: list[int] = []
        for e in sorted(events, key=lambda e: (round(e["ts"] * 1000), -round(e["dur"] * 1000))):
            a, b = round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)
            while open_ends and open_ends[-1] <= a:
                open_ends.pop()
            assert not open_ends or b <= open_ends[-1], f"{e} overlaps its parent without nesting"
            open_ends.append(b)
    return tracks


def thread_names(doc: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}


@pytest.fixture(scope="module")
def passes() -> dict[str, tuple[list[Span], float]]:
    return {"serial": run_pass(overlap=False), "overlap": run_pass(overlap=True)}


def test_chrome_trace_matches_spans_and_wall_time(passes, tmp_path):
    spans, wall = passes["overlap"]
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    doc = json.loads(path.read_text())
    tracks = check_chrome_trace(doc)
    lanes = thread_names(doc)
    assert sorted(lanes.values()) == ["compute", "copy", "cpu-copy-0"]
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"] == ["moestream"]

    for (pid, tid), events in tracks.items():
        lane = lanes[pid, tid]
        expect = [s for s in spans if s.lane == lane]
        assert len(events) == len(expect)
        expect_us = sum(s.duration for s in expect) * 1e6
        assert sum(e["dur"] for e in events) == pytest.approx(expect_us, abs=len(events) * 1e-3)
    uploads = [e for e in doc["traceEvents"] if e["name"] == "upload"]
    assert {e["args"]["layer"] for e in uploads} == set(range(N_LAYERS))
    assert all(e["args"]["bytes"] == NBYTES and e["args"]["slot"] in (0, 1) for e in uploads)
    assert all(e["args"]["GB/s"] == pytest.approx(NBYTES / e["dur"] / 1e3, rel=1e-3) for e in uploads)

    xs = [e for events in tracks.values() for e in events]
    extent_s = (max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)) / 1e6
    assert extent_s == pytest.approx(wall, rel=0.05)
    assert extent_s == pytest.approx(summarize(spans).wall_s, abs=1e-6)


def test_chrome_trace_one_process_per_schedule(passes, tmp_path):
    path = tmp_path / "both.json"
    write_chrome_trace({name: spans for name, (spans, _) in passes.items()}, path, process_name="qwen3")
    doc = json.loads(path.read_text())
    tracks = check_chrome_trace(doc)
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "qwen3 serial", 2: "qwen3 overlap"}
    assert {pid for pid, _ in tracks} == {1, 2}
    assert sum(len(v) for v in tracks.values()) == sum(len(spans) for spans, _ in passes.values())


def test_chrome_trace_moves_partly_overlapping_spans_to_an_extra_track(tmp_path):
    spans = [
        Span("compute", "experts", 0.0, 2.0, layer=0),
        Span("compute", "dequant", 0.0, 1.0, layer=0),  # nested: same track
        Span("compute", "attention", 1.5, 3.0, layer=1),  # crosses the end of experts: another track
        Span("compute", "router", 3.0, 3.5, layer=1),  # starts where attention ends: back on the first track
    ]
    path = tmp_path / "t.json"
    write_chrome_trace(spans, path)
    doc = json.loads(path.read_text())
    tracks = check_chrome_trace(doc)
    lanes = thread_names(doc)
    by_track = {lanes[k]: sorted(e["name"] for e in v) for k, v in tracks.items()}
    assert by_track == {"compute": ["dequant", "experts", "router"], "compute #2": ["attention"]}


def _trace_processor_shell() -> str | None:
    """A trace_processor_shell runnable offline: $PERFETTO_TRACE_PROCESSOR or the perfetto package's cache."""
    if path := os.environ.get("PERFETTO_TRACE_PROCESSOR"):
        return path
    cached = glob.glob(os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell-*"))
    return next((p for p in cached if not p.endswith(".tmp")), None)


def test_perfetto_trace_processor_loads_the_trace(passes, tmp_path):
    tp_api = pytest.importorskip("perfetto.trace_processor")
    shell = _trace_processor_shell()
    if shell is None:
        pytest.skip("no trace_processor_shell: the perfetto package downloads it and this machine is offline")
    traces = {name: spans for name, (spans, _) in passes.items()}
    path = tmp_path / "trace.json"
    write_chrome_trace(traces, path)
    tp = tp_api.TraceProcessor(trace=str(path), config=tp_api.TraceProcessorConfig(bin_path=shell))
    try:
        rows = list(
            tp.query(
                "select p.name as process, t.name as thread, s.name as name, s.ts as ts, s.dur as dur "
                "from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid) "
                "join process p using (upid)"
            )
        )
    finally:
        tp.close()
    assert len(rows) == sum(len(spans) for spans in traces.values())
    for run, spans in traces.items():
        mine = [r for r in rows if r.process == f"moestream {run}"]
        for lane in {s.lane for s in spans}:
            dur_ns = sum(r.dur for r in mine if r.thread == lane)
            expect_ns = sum(s.duration for s in spans if s.lane == lane) * 1e9
            assert dur_ns == pytest.approx(expect_ns, abs=len(mine))
        extent_s = (max(r.ts + r.dur for r in mine) - min(r.ts for r in mine)) / 1e9
        assert extent_s == pytest.approx(passes[run][1], rel=0.05)


def test_png_timeline_one_row_per_schedule(passes, tmp_path):
    path = tmp_path / "timeline.png"
    plot_timelines({name: spans for name, (spans, _) in passes.items()}, path, title="tiny, 6 layers")
    assert path.stat().st_size > 20_000
    img = imread(path)
    h, w = img.shape[:2]
    assert w >= 1500 and h >= 400
    assert img[..., :3].std() > 0.1  # bars, not a blank canvas
    one = tmp_path / "one.png"
    plot_timelines({"overlap": passes["overlap"][0]}, one)
    assert imread(one).shape[0] < h  # a row fewer


def test_png_timeline_without_spans(tmp_path):
    path = Path(tmp_path / "empty.png")
    plot_timelines({"serial": []}, path)
    assert imread(path).shape[0] > 0
