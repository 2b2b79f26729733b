"""Why `--streamed-layers spread` exists, shown with real threads on the CPU device: with the first N layers
streamed, a one-micro-batch prompt computes every resident layer after the last upload; with N evenly spaced
layers the resident layers compute while the streamed ones upload."""

from __future__ import annotations

import time

import pytest

import moestream
from moestream.offload.device import CpuDevice

pytestmark = pytest.mark.usefixtures("one_thread")  # timing and tiny tensors: no thread contention

TOKENS = list(range(5, 37))  # one micro-batch of 32


def pass_time(path: str, streamed_layers: str) -> float:
    dev = CpuDevice(copy_delay_s=0.05, compute_delay_s=0.075)  # 150 ms to upload a layer, 75 ms to compute one
    e = moestream.load(
        path,
        device="cpu",
        ubatch=32,
        stream_min_batch=8,
        n_cpu_moe=4,
        slots=3,
        progress=False,
        streamed_layers=streamed_layers,
        device_impl=dev,
    )
    try:
        e.forward(TOKENS, e.new_cache())
        for s in e.experts.streamer.slots:
            s.layer = None  # nothing reused from the warm-up pass
        t0 = time.perf_counter()
        e.forward(TOKENS, e.new_cache())
        return time.perf_counter() - t0
    finally:
        e.close()
        dev.close()


def test_spread_hides_resident_compute_under_uploads(model_file):
    path = model_file("tiny", "Q8_0", layers=8)
    first, spread = pass_time(path, "first"), pass_time(path, "spread")
    # first: 4 uploads (600 ms), its last layer, then 4 resident layers (375 ms): ~975 ms; spread: ~675 ms
    assert spread < 0.85 * first, f"spread {spread * 1e3:.0f} ms vs first {first * 1e3:.0f} ms"
