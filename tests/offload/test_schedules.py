"""Every schedule and slot count gives the all-resident logits bit for bit when expert math runs on the device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.offload.device import CpuDevice
from moestream.offload.placement import Placement, workspace_bytes
from moestream.options import Options, Schedule
from moestream.profiling.timeline import Timeline
from moestream.runtime.sampling import SamplingParams

TOKENS = torch.randint(0, 1280, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def run(path, tokens=TOKENS, device_impl=None, **opts):
    engine = moestream.load(
        path, device="cpu", ubatch=16, stream_min_batch=8, progress=False, device_impl=device_impl, **opts
    )
    try:
        return engine.logits(tokens), engine.experts.streamer
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(model_file):
    return {p: run(model_file(p, "Q4_K_M"), n_cpu_moe=0)[0] for p in ("tiny", "tiny-qwen35moe", "tiny-glm4moe")}


@pytest.mark.parametrize("stream", ["serial", "pinned", "overlap", "layer-major"])
@pytest.mark.parametrize(
    "preset,n_cpu_moe,slots",
    [
        ("tiny", 1, 2),
        ("tiny", 2, 2),
        ("tiny", 2, 3),
        ("tiny", "all", 4),
        ("tiny-qwen35moe", 3, 2),
        ("tiny-qwen35moe", "all", 3),
        ("tiny-glm4moe", 2, 2),
        ("tiny-glm4moe", "all", 2),
    ],
)
def test_bit_identical_to_resident(model_file, reference, stream, preset, n_cpu_moe, slots):
    """Layer-major must also carry qwen35moe's delta-net state across micro-batches exactly; glm4moe's first
    layer has no experts to stream (-ncmoe 2 streams its second)."""
    logits, _ = run(
        model_file(preset, "Q4_K_M"),
        n_cpu_moe=n_cpu_moe,
        stream=stream,
        slots=slots,
        device_impl=CpuDevice(copy_delay_s=0.002, compute_delay_s=0.001),
    )
    ref = reference[preset]
    assert torch.equal(logits, ref), f"max diff {(logits - ref).abs().max():.3e}"


def test_layer_major_uploads_each_layer_once(model_file):
    """3 streamed layers, 2 slots, 3 micro-batches: token-major re-uploads, layer-major sends each layer once."""
    path = model_file("tiny-odd", "Q8_0")
    tm_logits, s_tm = run(path, n_cpu_moe="all", stream="overlap", slots=2)
    lm_logits, s_lm = run(path, n_cpu_moe="all", stream="layer-major", slots=2)
    one_pass = sum(p.numel() for layer in s_tm.layers.values() for p in layer.parts)
    assert s_lm.bytes_uploaded == one_pass and s_lm.uploads == 3
    assert s_tm.bytes_uploaded >= 2 * one_pass
    assert torch.equal(tm_logits, lm_logits)


@pytest.mark.parametrize("n_cpu_moe", [0, 1, "all"])
def test_kept_dequantized_stacks_give_the_same_bits_from_one_dequantization_a_layer(model_file, n_cpu_moe):
    """--keep-dequantized: 40 tokens in micro-batches of 16, 16 and 8 dequantize each layer's three stacks once,
    not once a micro-batch, resident or streamed; the logits do not move by a bit."""
    path = model_file("tiny", "Q4_K_M")

    def dequants(keep: bool) -> tuple[torch.Tensor, int, int, int]:
        engine = moestream.load(
            path, device="cpu", ubatch=16, stream_min_batch=8, progress=False, n_cpu_moe=n_cpu_moe,
            stream="layer-major", keep_dequantized=keep,
        )  # fmt: skip
        try:
            timeline = Timeline(engine.device)
            engine.record(timeline)
            logits = engine.logits(TOKENS)
            n = sum(s.name == "dequant" for s in timeline.resolve())
            return logits, n, engine.spec.n_layer, engine.offload.footprint.workspace
        finally:
            engine.close()

    (each, n_each, n_layer, ws_each), (kept, n_kept, _, ws_kept) = dequants(False), dequants(True)
    assert torch.equal(kept, each)
    assert n_kept == 3 * n_layer and n_each == 3 * n_kept
    assert ws_kept > ws_each  # the two more stacks are budgeted


def test_kept_dequantized_stacks_are_budgeted_only_where_they_are_kept():
    """Three stacks in the workspace for layer-major prompts longer than a micro-batch, one otherwise."""
    from moestream.tools.presets import get_preset

    spec = get_preset("qwen3-30b-a3b").spec
    stack = spec.n_expert * spec.n_ff_exp * spec.n_embd * 2
    one = Options.make(device="cpu", stream="layer-major")
    kept = Options.make(device="cpu", stream="layer-major", keep_dequantized=True)
    tm = Options.make(device="cpu", stream="overlap", keep_dequantized=True)
    assert kept.streaming.keeps_dequantized(4096, 2048) and not kept.streaming.keeps_dequantized(2048, 2048)
    assert not one.streaming.keeps_dequantized(4096, 2048) and not tm.streaming.keeps_dequantized(4096, 2048)
    ws = [workspace_bytes(spec, 2048, 4096, torch.bfloat16, "cuda", stacks) for stacks in (1, 3)]
    assert ws[1] - ws[0] == 2 * stack


@pytest.mark.parametrize("small_batch", ["cpu", "upload", "gather", "auto"])
def test_small_batches_skip_whole_layer_uploads(model_file, small_batch):
    """Below --stream-min-batch, host experts are computed on the CPU, only the chosen ones are uploaded, or
    they are gathered from host memory; results agree with all-resident within float32 tolerance, and greedy
    tokens are the same. auto gathers only where a GPU reads the host: on the CPU device it uploads."""
    path = model_file("tiny", "Q4_K_M")  # 8 experts, 2 per token: 3 tokens choose 6, fewer than all 8
    ref = moestream.load(path, device="cpu", ubatch=3, progress=False)
    small = moestream.load(
        path,
        device="cpu",
        ubatch=3,
        stream_min_batch=32,
        n_cpu_moe="all",
        progress=False,
        small_batch=small_batch,
        device_impl=CpuDevice(copy_delay_s=0.001),
    )
    a, b = ref.logits(TOKENS[:12]), small.logits(TOKENS[:12])
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    assert small.experts.plan.way == ("upload" if small_batch == "auto" else small_batch)
    streamer = small.experts.streamer
    every_layer = sum(p.numel() for layer in streamer.layers.values() for p in layer.parts)
    if small_batch == "cpu":
        assert streamer.bytes_uploaded == 0
    elif small_batch == "gather":  # no copies: each micro-batch's chosen experts are read where they lie, once
        assert streamer.bytes_uploaded == 0 and small.experts.counters.bytes_moved <= 12 * 2 * every_layer // 8
        expert_bytes = {il: small.experts.tensors[il].expert_bytes for il in streamer.layers}
        distinct, before = [], small.experts.counters.bytes_moved

        def record(il, x, ids):
            distinct.append(ids.unique().numel() * expert_bytes[il])

        small.forward(TOKENS[:12], small.new_cache(), on_route=record)
        assert small.experts.counters.bytes_moved - before == sum(distinct) < 12 * 2 * every_layer // 8  # shared
    else:  # 4 micro-batches of 3 tokens: each uploads only the experts it chose, never a whole layer
        assert 0 < streamer.bytes_uploaded < 4 * every_layer
    params = SamplingParams(max_tokens=16, stop_at_eos=False)
    assert ref.generate(TOKENS[:12], params).tokens == small.generate(TOKENS[:12], params).tokens
    ref.close()
    small.close()


@pytest.mark.parametrize(
    "opts,words",
    [
        (dict(n_cpu_moe=-1), ["--n-cpu-moe -1"]),
        (dict(n_cpu_moe="auto"), ["--vram-budget"]),
        (dict(n_cpu_moe="auto", vram_budget="1MiB"), ["too small", "GiB"]),
        (dict(n_cpu_moe=0, vram_budget="2MiB"), ["--n-cpu-moe 0 needs", "auto"]),
        (dict(stream="fast"), ["--stream fast"]),
        (dict(slots=1), ["--slots 1"]),
    ],
)
def test_placement_errors(model_file, opts, words):
    with pytest.raises(MoestreamError) as e:
        moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, **opts)
    for w in words:
        assert w in str(e.value)


def test_auto_picks_smallest_n_that_fits(model_file):
    path = model_file("tiny-odd", "Q8_0")
    e = moestream.load(path, device="cpu", progress=False, n_cpu_moe="auto", vram_budget="100GiB", slots=2)
    assert e.offload.placement.n_cpu_moe == 0
    fp, p0 = e.offload.footprint, e.offload.placement
    e.close()
    budget = p0.gpu_bytes(fp) - 1  # one byte short of everything resident
    e = moestream.load(path, device="cpu", progress=False, n_cpu_moe="auto", vram_budget=budget, slots=2)
    chosen = e.offload.placement
    e.close()
    assert chosen.n_cpu_moe > 0 and chosen.gpu_bytes(fp) <= budget
    for n in range(chosen.n_cpu_moe):
        assert Placement(n, p0.expert_bytes, 2).gpu_bytes(fp) > budget


def test_spread_streams_evenly_spaced_layers_with_the_same_bits(model_file, reference):
    path = model_file("tiny-qwen35moe", "Q4_K_M")
    logits, _ = run(path, n_cpu_moe=2, streamed_layers="spread", stream="overlap")
    assert torch.equal(logits, reference["tiny-qwen35moe"])
    assert Placement(2, [1] * 4, 3, spread=True).streamed == [1, 3]
    assert Placement(26, [1] * 48, 3, spread=True).streamed == sorted(set(Placement(26, [1] * 48, 3, True).streamed))
    assert Placement(3, [1] * 4, 3, spread=True).resident == [1]


def test_layers_without_experts_are_neither_streamed_nor_resident(model_file):
    """-ncmoe N keeps the experts of blocks 0..N-1 in host RAM, as llama.cpp's does: a leading dense block
    counts and streams nothing; spread spaces N layers with experts."""
    dense_first = [0, 5, 5, 5]
    assert Placement(1, dense_first, 2).streamed == [] and Placement(1, dense_first, 2).resident == [1, 2, 3]
    assert Placement(2, dense_first, 2).streamed == [1] and Placement(4, dense_first, 2).resident == []
    assert Placement(2, dense_first, 2, spread=True).streamed == [1, 3]
    assert Placement(4, dense_first, 2, spread=True).streamed == [1, 2, 3]
    e = moestream.load(model_file("tiny-glm4moe", "Q4_K_M"), device="cpu", progress=False, n_cpu_moe=1)
    assert e.offload.placement.streamed == [] and e.experts.streamer is None
    e.close()


def test_auto_budgets_the_one_slot_serial_and_pinned_use(model_file):
    """-ncmoe auto --vram-budget: serial and pinned allocate one staging slot, so the budget counts one (it
    counted three, and streamed more layers than the budget needed)."""
    path = model_file("tiny-odd", "Q8_0")  # 3 layers
    e = moestream.load(path, device="cpu", progress=False, n_cpu_moe=0)
    fp, expert_bytes = e.offload.footprint, e.offload.placement.expert_bytes
    e.close()
    budget = Placement(2, expert_bytes, 1).gpu_bytes(fp)  # two layers streamed through one slot just fit
    for stream in ("serial", "pinned"):
        e = moestream.load(path, device="cpu", progress=False, n_cpu_moe="auto", vram_budget=budget, stream=stream)
        chosen, slots = e.offload.placement, len(e.experts.streamer.slots)
        e.close()
        assert slots == 1 and chosen.staging_bytes == chosen.slot_bytes
        assert chosen.n_cpu_moe == 2 and chosen.gpu_bytes(fp) <= budget
    with pytest.raises(MoestreamError, match="too small"):  # three slots do not fit that budget at all
        moestream.load(path, device="cpu", progress=False, n_cpu_moe="auto", vram_budget=budget, stream="overlap")


@pytest.mark.parametrize(
    ("stream", "slots", "expected"),
    [("serial", 3, 1), ("pinned", 3, 1), ("overlap", 3, 3), ("overlap", 2, 2), ("layer-major", 2, 2)],
)
def test_placement_budgets_the_slots_the_streamer_allocates(model_file, stream, slots, expected):
    """One rule, Schedule.staging_slots: serial and pinned budget and allocate exactly one slot, overlap and
    layer-major --slots (here all 3 layers stream, so none is clipped)."""
    e = moestream.load(
        model_file("tiny-odd", "Q8_0"), device="cpu", progress=False, n_cpu_moe="all", stream=stream, slots=slots
    )
    placement, allocated = e.offload.placement, len(e.experts.streamer.slots)
    e.close()
    assert placement.n_slots == allocated == expected
    assert placement.staging_bytes == expected * placement.slot_bytes


def test_schedule_parses_cli_strings_and_owns_the_slot_rule():
    assert [Schedule.parse(s) for s in ("serial", "pinned", "overlap", "layer-major")] == list(Schedule)
    assert Schedule.parse(Schedule.PINNED) is Schedule.PINNED and str(Schedule.LAYER_MAJOR) == "layer-major"
    with pytest.raises(MoestreamError, match="^--stream fast: expected one of serial, pinned, overlap, layer-major$"):
        Schedule.parse("fast")
    assert [s.staging_slots(4) for s in Schedule] == [1, 1, 4, 4]
    assert [s.page_locks for s in Schedule] == [False, True, True, True]


def test_stream_env_is_read_once_with_the_options(monkeypatch):
    monkeypatch.setenv("MOESTREAM_STREAM", "pinned")
    opts = Options.make(device="cpu")
    assert (
        opts.streaming.stream is Schedule.PINNED
        and Options.make(device="cpu", stream="serial").streaming.stream is Schedule.SERIAL
    )
    monkeypatch.setenv("MOESTREAM_STREAM", "fast")
    assert opts.replace(slots=2).streaming.stream is Schedule.PINNED  # settled options are not read again
    with pytest.raises(MoestreamError, match="MOESTREAM_STREAM=fast: expected one of"):  # the variable, not a flag
        Options.make(device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.streaming.stream = Schedule.OVERLAP
    monkeypatch.setenv("MOESTREAM_STREAM", " ")  # blank: the default, as a blank $MOESTREAM_DELTANET is auto
    assert Options.make(device="cpu").streaming.stream is Schedule.LAYER_MAJOR


def test_allocator_settings_are_left_to_a_user_who_configured_them(monkeypatch):
    """Under a budget moestream turns on expandable segments, unless $PYTORCH_CUDA_ALLOC_CONF (or its new name)
    configures torch's allocator: read with the options, not when the cap is set."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert Options.make(device="cpu").placement.expandable_segments is True
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "max_split_size_mb:256")
        assert Options.make(device="cpu").placement.expandable_segments is False
        monkeypatch.delenv(name)
    assert Options.make(device="cpu", expandable_segments=False).placement.expandable_segments is False


def test_every_sequence_the_server_holds_is_budgeted(model_file):
    """--max-seqs N (n_seqs) budgets N KV caches: under one budget, four sequences stream every layer where
    one streams none, and a budget that fits one sequence is refused for four, naming --max-seqs (the GPU load
    test ran out of memory once its other caches came on top of an expert cache sized for one)."""
    path = model_file("tiny-odd", "Q8_0")  # 3 layers; serial: one staging slot, so streaming them all saves two
    opts = dict(device="cpu", progress=False, stream="serial")
    e = moestream.load(path, n_cpu_moe=0, **opts)
    fp, expert_bytes = e.offload.footprint, e.offload.placement.expert_bytes
    e.close()
    e = moestream.load(path, n_cpu_moe=0, n_seqs=4, **opts)
    fp4 = e.offload.footprint
    e.close()
    assert fp4.kv_cache == 4 * fp.kv_cache
    budget = Placement(3, expert_bytes, 1).gpu_bytes(fp4)  # four caches, every layer streamed: just fits
    for n_seqs, streamed in ((1, 0), (4, 3)):
        e = moestream.load(path, n_cpu_moe="auto", vram_budget=budget, n_seqs=n_seqs, **opts)
        assert e.offload.placement.n_cpu_moe == streamed
        e.close()
    with pytest.raises(MoestreamError, match="--max-seqs"):
        moestream.load(
            path, n_cpu_moe="auto", vram_budget=Placement(0, expert_bytes, 1).gpu_bytes(fp), n_seqs=4, **opts
        )
    with pytest.raises(MoestreamError, match="--max-seqs 0: must be at least 1"):
        Options.make(device="cpu", n_seqs=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_the_budgeted_sequence_is_the_cache_the_engine_allocates(model_file, preset):
    """A sequence's share of the footprint is what new_cache allocates: the KV cache and, for delta-net
    layers, the recurrent state."""
    e = moestream.load(model_file(preset, "Q8_0"), device="cpu", progress=False, n_seqs=2)
    try:
        cache = e.new_cache()
        kv = [*cache.kv.k.values(), *cache.kv.v.values()]
        states = [t for s in cache.recurrent.values() for t in (s.conv_state, s.recurrent_state)]
        assert bool(states) == (preset == "tiny-qwen35moe")
        assert e.offload.footprint.kv_cache == 2 * sum(t.nbytes for t in kv + states)
    finally:
        e.close()


def test_cpu_layers_compute_beside_the_gathered_ones(model_file):
    """--cpu-layers 1 of the 2 streamed layers: that layer's small batches compute on the CPU, the other
    gathers and alone is guessed ahead and cached; greedy tokens as all-resident, logits within float32."""
    path = model_file("tiny", "Q4_K_M")
    ref = moestream.load(path, device="cpu", progress=False)
    mixed = moestream.load(
        path, device="cpu", n_cpu_moe="all", small_batch="gather", cpu_layers=1, prefetch=2, progress=False
    )
    assert mixed.experts.on_cpu == {1} and sorted(mixed.experts.prefetcher.ring) == [0]
    params = SamplingParams(max_tokens=8, stop_at_eos=False)
    assert ref.generate(TOKENS[:6], params).tokens == mixed.generate(TOKENS[:6], params).tokens
    a, b = ref.logits(TOKENS[:3]), mixed.logits(TOKENS[:3])
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5
