"""The engine's own timeline on the CPU device with injected slow copies or slow compute: the summary must
report what the injection implies."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.offload.device import CpuDevice
from moestream.profiling.timeline import NULL, Timeline
from moestream.tools.profile import profile_pass

pytestmark = pytest.mark.usefixtures("one_thread")  # timing and tiny tensors: no thread contention

TOKENS = list(range(7, 103))  # 96 tokens: 3 micro-batches of 32


def load_streamed(model_file, **opts):
    """The tiny-odd model with every layer's experts streamed through 2 slots, 32 tokens a micro-batch."""
    return moestream.load(
        model_file("tiny-odd", "Q8_0"),
        device="cpu",
        ubatch=32,
        stream_min_batch=8,
        n_cpu_moe="all",
        slots=2,
        progress=False,
        **opts,
    )


def profile(model_file, schedule: str, copy_s: float, compute_s: float):
    dev = CpuDevice(copy_delay_s=copy_s, compute_delay_s=compute_s)
    e = load_streamed(model_file, device_impl=dev)
    try:
        return profile_pass(e, TOKENS, schedule, repeats=1), e.experts.streamer
    finally:
        e.close()
        dev.close()


def test_serial_hides_nothing(model_file):
    r, streamer = profile(model_file, "serial", copy_s=0.02, compute_s=0.002)
    s = r.summary
    assert s.wall_s == r.wall_on_s  # one recorded wall: the header's and the table's
    assert sum(s.compute_by_name.values()) <= s.compute_busy_s * 1.001  # each op's own time
    assert s.overlap_pct < 10, s.overlap_pct
    n_copies = 3 * 9  # gate, up, down of 3 layers, for each of 3 micro-batches (one slot: nothing stays)
    assert s.copy_busy_s >= 0.9 * n_copies * 0.02
    assert s.idle_pct > 50  # compute waits for every upload
    assert s.wait_on_upload_s > 0.5 * s.copy_busy_s


def test_overlap_copy_bound_keeps_the_link_busy(model_file):
    r, _ = profile(model_file, "overlap", copy_s=0.03, compute_s=0.001)
    s = r.summary
    assert s.copy_busy_s / s.wall_s > 0.8, f"link busy {s.copy_busy_s / s.wall_s:.0%} of the pass"
    assert s.hidden_copy_s >= 0.5 * s.compute_busy_s  # compute runs under the copies
    expected_gbs = s.bytes_copied / (s.copy_busy_s * 1e9)
    assert s.copy_gbps == pytest.approx(expected_gbs, rel=0.01)
    n_tensors = 3 * sum(1 for sp in r.spans if sp.lane == "copy")  # one upload span: gate, up and down
    per_copy_gbs = s.bytes_copied / n_tensors / 0.03 / 1e9
    assert s.copy_gbps == pytest.approx(per_copy_gbs, rel=0.35)  # each tensor took about the injected 30 ms


def test_overlap_compute_bound_has_little_idle(model_file):
    r, _ = profile(model_file, "overlap", copy_s=0.001, compute_s=0.04)
    s = r.summary
    assert s.idle_pct < 20, s.idle_pct
    assert s.overlap_pct > 50, s.overlap_pct  # ~90% idle machine; serial hides 0%


def test_layer_major_uploads_once(model_file):
    r, streamer = profile(model_file, "layer-major", copy_s=0.005, compute_s=0.001)
    layers = [sp.layer for sp in r.spans if sp.lane == "copy"]
    # one upload per layer, each layer at most once; a layer still in a slot from the warm-up pass is reused
    assert sorted(layers) == sorted(set(layers)) and set(layers) <= {0, 1, 2} and len(set(layers)) >= 2


@pytest.mark.parametrize("schedule", ["serial", "overlap", "layer-major"])
def test_recording_changes_no_output(model_file, schedule):
    """Recording only stamps events: the logits of every position are bit-identical with it on and off."""
    e = load_streamed(model_file, stream=schedule)
    try:
        off = e.forward(TOKENS, e.new_cache(), all_logits=True)
        timeline = Timeline(e.device)
        e.record(timeline)
        on = e.forward(TOKENS, e.new_cache(), all_logits=True)
        e.record(NULL)
        assert timeline.resolve(), "nothing was recorded"
        assert torch.equal(off, on)
    finally:
        e.close()
