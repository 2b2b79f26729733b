"""Expert parallel over several devices (--devices, --tensor-split), simulated by CPU devices with one copy
thread each: every schedule gives the logits of one device, each device's link carries only its range."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.offload.device import CpuDevice
from moestream.offload.shards import expert_ranges
from moestream.options import Options
from moestream.runtime.sampling import SamplingParams

TOKENS = [(7 * t) % 1000 + 3 for t in range(40)]  # 3 micro-batches of 16, 16, 8: whole-layer uploads
STREAMED = dict(ubatch=16, stream_min_batch=8, n_cpu_moe="all", slots=2, small_batch="gather", progress=False)


@pytest.mark.parametrize(
    "n,split,want",
    [
        (8, (1, 1), [(0, 4), (4, 8)]),
        (128, (3, 1), [(0, 96), (96, 128)]),
        (8, (0, 1), [(0, 0), (0, 8)]),
        (7, (1, 1, 1), [(0, 2), (2, 5), (5, 7)]),
    ],
)
def test_expert_ranges_follow_the_weights(n, split, want):
    assert expert_ranges(n, split) == want


def load_on(path, n_devices: int, split: str | None, **opts):
    devs = [CpuDevice(copy_delay_s=0.001) for _ in range(n_devices)]
    engine = moestream.load(path, device_impl=devs, devices=",".join(["cpu"] * n_devices), tensor_split=split, **opts)
    return engine, devs


@pytest.mark.parametrize("stream", ["serial", "pinned", "overlap", "layer-major"])
@pytest.mark.parametrize("split", ["1,1", "3,1", "1,1,1", "0,1"])
def test_every_schedule_matches_one_device(model_file, stream, split):
    path = model_file("tiny", "Q4_K_M")
    one = moestream.load(path, device="cpu", stream=stream, **STREAMED)
    want = one.logits(TOKENS)
    one_bytes = one.experts.counters.bytes_moved
    one.close()
    engine, devs = load_on(path, len(split.split(",")), split, stream=stream, **STREAMED)
    try:
        got = engine.logits(TOKENS)
        streamer = engine.experts.streamer
        assert torch.equal(got, want)
        assert engine.experts.counters.bytes_moved == one_bytes  # the same bytes, split over the links
        per_expert = {
            b // (hi - lo) for b, (lo, hi) in zip(streamer.link_bytes, streamer.ranges, strict=True) if hi > lo
        }
        assert len(per_expert) == 1 and min(streamer.link_bytes) >= 0  # each link carried just its range
        assert [b == 0 for b in streamer.link_bytes] == [hi == lo for lo, hi in streamer.ranges]
    finally:
        engine.close()
        for d in devs:
            d.close()


def test_generation_matches_one_device(model_file):
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=8, stop_at_eos=False)
    one = moestream.load(path, device="cpu", **STREAMED)
    want = one.generate(TOKENS, params).tokens
    one.close()
    engine, devs = load_on(path, 2, None, **STREAMED)
    try:
        assert engine.generate(TOKENS, params).tokens == want
    finally:
        engine.close()
        for d in devs:
            d.close()


@pytest.mark.parametrize(
    "opts,words",
    [
        (dict(devices="cpu,cuda:0"), ["--devices cpu,cuda:0", "distinct GPUs"]),
        (dict(devices="tpu:0"), ["--devices tpu:0", "cuda:N"]),
        (dict(devices="cpu,cpu", tensor_split="1,1,1"), ["--tensor-split", "2 non-negative weights"]),
        (dict(devices="cpu,cpu", tensor_split="1,-1"), ["--tensor-split", "non-negative"]),
        (dict(devices="cpu,cpu", tensor_split="0,0"), ["not all 0"]),
        (dict(devices="cpu,cpu", tensor_split="a,b"), ["--tensor-split a,b", "weights"]),
        (dict(tensor_split="1,1"), ["give --devices too"]),
        (dict(device="cpu", devices="cuda:0,cuda:1"), ["--devices cuda:0,cuda:1"]),
    ],
)
def test_bad_device_lists_are_refused_with_the_flag_named(opts, words):
    with pytest.raises(MoestreamError) as e:
        Options.make(**opts)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_llama_cpp_device_names_are_understood():
    if torch.cuda.device_count() >= 2:
        assert Options.make(devices="CUDA0,CUDA1").placement.devices == ("cuda:0", "cuda:1")
    assert Options.make(devices="cpu,cpu", tensor_split="3,1").placement.tensor_split == (3.0, 1.0)


def test_small_batch_upload_is_refused_with_several_devices():
    """Before any weight moves: the options say so."""
    with pytest.raises(MoestreamError, match="--small-batch upload with several --devices"):
        Options.make(devices="cpu,cpu", small_batch="upload")


def test_a_gpu_index_torch_does_not_see_is_refused_by_name():
    """--devices checks each index against the GPUs torch sees (none here: every index)."""
    n = torch.cuda.device_count()
    with pytest.raises(MoestreamError, match=f"--devices cuda:{n},cuda:{n + 1}: torch sees {n} GPU"):
        Options.make(devices=f"cuda:{n},cuda:{n + 1}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_device_index_past_the_gpus_is_refused_by_name():
    """--device cuda:N was checked by its name only; now by the same count as --devices."""
    n = torch.cuda.device_count()
    with pytest.raises(MoestreamError, match=f"--device cuda:{n}: torch sees {n} GPU"):
        Options.make(device=f"cuda:{n}")
    assert Options.make(device=f"cuda:{n - 1}").model.device == f"cuda:{n - 1}"
