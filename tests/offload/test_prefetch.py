"""Next-layer prefetch of gathered layers' experts: whatever the guess, the same tokens and bits as without
it, every pick counted, and the guessed bytes budgeted."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.offload import prefetch
from moestream.offload.options import EngineOptions
from moestream.offload.placement import Footprint, Placement
from moestream.offload.prefetch import ring_bytes
from moestream.profiling.timeline import NULL, Timeline
from moestream.runtime.sampling import SamplingParams

PROMPT = [(11 * t) % 1000 + 5 for t in range(12)]
GATHERED = dict(device="cpu", n_cpu_moe="all", small_batch="gather", progress=False)


def decode(engine, n: int = 10) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the last step's logits of one-token static steps after the prompt."""
    cache = engine.new_cache()
    logits = engine.forward(PROMPT, cache)
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = engine.forward([tokens[-1]], cache)
    return tokens, logits


@pytest.mark.parametrize("preset", ["tiny", "tiny-odd", "tiny-qwen35moe"])
def test_every_guess_width_gives_the_unguessed_bits(model_file, preset):
    """Width 1 misses most picks, the expert count misses none: the rows read are the same experts either way."""
    path = model_file(preset, "Q4_K_M")
    off = moestream.load(path, prefetch=0, **GATHERED)
    want = decode(off)
    spec = off.spec
    off.close()
    for width in (1, spec.n_expert_used, spec.n_expert):
        e = moestream.load(path, prefetch=width, **GATHERED)
        try:
            assert e.model.experts.guess_width == width
            tokens, logits = decode(e)
            picks, misses, miss_bytes = e.model.experts.prefetch_stats()
        finally:
            e.close()
        assert tokens == want[0]
        assert torch.equal(logits, want[1])
        assert picks == 10 * spec.n_layer * spec.n_expert_used  # every step, every layer, every pick
        if width == spec.n_expert:
            assert misses == 0 and miss_bytes == 0
        if width == 1:
            assert misses >= 10 * spec.n_layer * (spec.n_expert_used - 1)
        assert 0 <= misses <= picks


def test_generation_matches_resident_with_prefetch_on_by_default(model_file):
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    ref = moestream.load(path, device="cpu", progress=False)
    want = ref.generate(PROMPT, params).tokens
    ref.close()
    e = moestream.load(path, **GATHERED)
    try:
        experts = e.model.experts
        assert experts.guess_width == e.spec.n_expert_used
        assert e.generate(PROMPT, params).tokens == want
        cache = e.new_cache()
        e.forward(PROMPT, cache)
        before, counted = experts.bytes_moved, experts.prefetch_stats()
        for t in want[:4]:
            e.forward([t], cache)
        picks, _, miss_bytes = (b - a for a, b in zip(counted, experts.prefetch_stats(), strict=True))
        per_expert = sum(t.nbytes // t.n_expert for t in experts.tensors.values())  # of every layer
        # each step's guesses of each layer, then its misses
        assert experts.bytes_moved - before == 4 * per_expert * experts.guess_width + miss_bytes
        assert picks == 4 * e.spec.n_layer * e.spec.n_expert_used
    finally:
        e.close()


@pytest.mark.parametrize("lead", ["layer", "streamed"])
@pytest.mark.parametrize("n_cpu_moe", [1, 2])
def test_a_spread_placement_guesses_across_resident_layers(model_file, n_cpu_moe, lead, monkeypatch):
    """tiny-odd's 3 layers with 1 or 2 streamed, spread: guesses for a layer after a resident one (made there,
    or at the streamed layer before it), and for layer 0 from the embedding; the all-resident model's tokens."""
    monkeypatch.setattr(prefetch, "LEAD", lead)
    path = model_file("tiny-odd", "Q4_K_M")
    ref = moestream.load(path, device="cpu", progress=False)
    want = decode(ref)[0]
    ref.close()
    e = moestream.load(path, **(GATHERED | dict(n_cpu_moe=n_cpu_moe, streamed_layers="spread")))
    try:
        streamed = e.offload.placement.streamed
        assert sorted(e.model.experts.prefetcher.ring) == streamed
        at = [s - 1 for s in streamed] if lead == "layer" else [streamed[0] - 1, *streamed[:-1]]
        assert e.model.experts.prefetcher.schedule() == dict(zip(at, streamed, strict=True))
        assert decode(e)[0] == want
        assert e.model.experts.prefetch_stats()[0] == 10 * n_cpu_moe * e.spec.n_expert_used
    finally:
        e.close()


def test_only_gathered_one_token_static_passes_guess(model_file):
    path = model_file("tiny", "Q4_K_M")
    e = moestream.load(path, device="cpu", n_cpu_moe="all", small_batch="upload", progress=False)
    assert e.model.experts.prefetcher is None and e.model.experts.guess_plan(1) == {}
    e.close()
    e = moestream.load(path, **GATHERED)
    try:
        experts = e.model.experts
        assert experts.guess_plan(1) == {}  # outside a static pass
        experts.static = True
        assert experts.guess_plan(1) == {il - 1: il for il in range(e.spec.n_layer)} and experts.guess_plan(2) == {}
        experts.static = False
    finally:
        e.close()
    e = moestream.load(path, stream_min_batch=1, **GATHERED)  # one-token steps upload whole layers
    try:
        decode(e, 3)
        assert e.model.experts.prefetch_stats() == (0, 0, 0) and not e.model.experts.prefetcher.pending
        e.model.experts.static = True
        assert e.model.experts.guess_plan(1) == {}
    finally:
        e.close()


def test_the_guess_ring_is_budgeted_as_allocated_and_only_when_layers_stream(model_file):
    e = moestream.load(model_file("tiny", "Q4_K_M"), **GATHERED)
    try:
        p, fp = e.model.experts.prefetcher, e.offload.footprint
        allocated = sum(buf.numel() for slot in p.slots for buf in slot.bufs)
        assert fp.prefetch == allocated == ring_bytes(p.tensors, p.tensors, p.n_guess, p.n_used) > 0
    finally:
        e.close()
    fp = Footprint(dense=100, kv_cache=10, workspace=1, prefetch=5000)
    assert Placement(0, [8000, 8000], n_slots=1).gpu_bytes(fp) == 111 + 16000
    assert Placement(1, [8000, 8000], n_slots=1).gpu_bytes(fp) == 111 + 8000 + 8000 + 5000


def test_bad_widths_are_refused(model_file):
    with pytest.raises(MoestreamError, match="--prefetch -1"):
        EngineOptions(prefetch=-1)
    with pytest.raises(MoestreamError, match="--prefetch 9: the model has 8 experts"):
        moestream.load(
            model_file("tiny", "Q4_K_M"), prefetch=9, **{k: v for k, v in GATHERED.items() if k != "n_cpu_moe"}
        )


def test_the_placement_line_and_the_timeline_show_the_guesses(model_file):
    e = moestream.load(model_file("tiny", "Q4_K_M"), **GATHERED)
    try:
        assert "decode: 2 experts of each streamed layer guessed ahead" in e.offload.describe()
        timeline = Timeline(e.device)
        e.record(timeline)
        decode(e, 3)
        e.record(NULL)
        spans = [s for s in timeline.resolve() if s.name == "prefetch"]
        assert [s.layer for s in spans] == [0, 1] * 3 and all(s.lane == "copy" and s.nbytes > 0 for s in spans)
    finally:
        e.close()
