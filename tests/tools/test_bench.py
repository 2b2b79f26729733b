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


def test_bench_tokens_repeat_a_text_to_length():
    assert bench_tokens([5, 6, 7], 7, 100) == [5, 6, 7, 5, 6, 7, 5]
    assert bench_tokens([5, 6, 7], 2, 100) == [5, 6]
    assert bench_tokens(None, 4, 100) == bench_tokens(None, 4, 100) and len(bench_tokens(None, 4, 100)) == 4
