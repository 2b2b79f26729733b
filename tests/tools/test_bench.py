"""The bench's copy rate: bytes over the time the copies took, on the CPU device with a slow injected link."""

from __future__ import annotations

import pytest

import moestream
from moestream.offload.device import CpuDevice
from moestream.tools.bench import bench_tokens, run_bench
from moestream.tools.sweep import Sweep

pytestmark = pytest.mark.usefixtures("one_thread")


def test_copy_rate_is_bytes_over_copy_time(model_file):
    # every tensor takes 20 ms to cross the "link", 60 ms a layer; each layer computes for 80 ms, so the link sits
    # idle a quarter of the run. (At 10 ms it idled only at the ends, and a warm-up whose copies ran 7% slow, under
    # load, once put the run's link rate above the copy rate measured there.)
    dev = CpuDevice(copy_delay_s=0.02, compute_delay_s=0.08)
    e = moestream.load(
        model_file("tiny-odd", "Q8_0"),
        device="cpu",
        ubatch=32,
        stream_min_batch=8,
        n_cpu_moe="all",
        slots=2,
        progress=False,
        device_impl=dev,
    )
    try:
        tensor_bytes = e.offload.placement.expert_bytes[0] / 3  # gate, up and down are the same size here
        sweep = Sweep([32], [0], [32], ["all"], ["overlap", "serial"], [2], ["first"], repeats=1, floors=False)
        rows, _ = run_bench(e, sweep)
    finally:
        e.close()
        dev.close()
    for r in rows:
        assert r.copy_gbs == pytest.approx(tensor_bytes / 0.02 / 1e9, rel=0.3), r.stream
        assert r.link_gbs < r.copy_gbs  # over the whole run the link also sat idle


def test_depth_rows_time_the_test_not_the_context_before_it(model_file):
    """-d 48: each test runs after 48 tokens of context (three micro-batches, each uploading both streamed
    layers through one slot); the rows say so as llama-bench does, and neither the time nor the bytes of that
    prefill are the row's: pp16 @ d48 uploads what pp16 does and takes about its time."""
    dev = CpuDevice(copy_delay_s=0.05)  # 0.3 s to upload the two layers' three stacks
    e = moestream.load(
        model_file("tiny", "Q4_K_M"),
        device="cpu",
        ubatch=16,
        n_ctx=80,
        stream_min_batch=8,
        n_cpu_moe="all",
        stream="pinned",
        progress=False,
        device_impl=dev,
    )
    try:
        sweep = Sweep([16], [4], [16], ["all"], ["pinned"], [2], ["first"], depths=[0, 48], repeats=2, floors=False)
        rows, _ = run_bench(e, sweep)
    finally:
        e.close()
        dev.close()
    by = {r.test: r for r in rows}
    assert list(by) == ["pp16", "tg4", "pp16 @ d48", "tg4 @ d48"]
    assert [r.n_depth for r in rows] == [0, 0, 48, 48] and [r.n_tokens for r in rows] == [16, 4, 16, 4]
    base, deep = by["pp16"], by["pp16 @ d48"]
    assert deep.bytes_uploaded == base.bytes_uploaded > 0
    assert deep.seconds - base.seconds < 0.45, (deep.samples_s, base.samples_s)  # timed, the depth adds 0.9 s
    assert all(r.tps > 0 for r in rows)


def test_bench_tokens_repeat_a_text_to_length_the_test_continuing_its_context():
    assert bench_tokens([5, 6, 7], 7, 100) == ([], [5, 6, 7, 5, 6, 7, 5])
    assert bench_tokens([5, 6, 7], 2, 100) == ([], [5, 6])
    assert bench_tokens([5, 6, 7], 2, 100, depth=4) == ([5, 6, 7, 5], [6, 7])
    context, tokens = bench_tokens(None, 4, 100, depth=3)
    assert (context, tokens) == bench_tokens(None, 4, 100, depth=3) and len(context) == 3 and len(tokens) == 4
