"""Next-layer prefetch of gathered layers' experts: whatever the guess, the same tokens and bits as without
it, every pick counted, and the guessed bytes budgeted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.offload import prefetch
from moestream.offload.placement import CACHE_SLACK, Footprint, Placement, cache_rows, cached_experts
from moestream.offload.prefetch import ring_bytes
from moestream.options import Options
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


@pytest.mark.parametrize("preset", ["tiny", "tiny-odd", "tiny-qwen35moe", "tiny-glm4moe"])
def test_every_guess_width_gives_the_unguessed_bits(model_file, preset):
    """Width 1 misses most picks, the expert count misses none: the rows read are the same experts either way
    (glm4moe: its first layer has no experts; the second's guess is made from the embedding)."""
    path = model_file(preset, "Q4_K_M")
    off = moestream.load(path, prefetch=0, **GATHERED)
    want = decode(off)
    spec = off.spec
    off.close()
    for width in (1, spec.n_expert_used, spec.n_expert):
        e = moestream.load(path, prefetch=width, **GATHERED)
        try:
            assert e.experts.guess_width == width
            tokens, logits = decode(e)
            picks, misses, miss_bytes, _, cached = e.experts.counters.stats()
        finally:
            e.close()
        assert tokens == want[0]
        assert torch.equal(logits, want[1])
        n_moe = len(spec.expert_layers)
        assert picks == 10 * n_moe * spec.n_expert_used  # every step, every layer with experts, every pick
        if width == spec.n_expert:
            assert misses == 0 and miss_bytes == 0
        if width == 1:
            assert misses >= 10 * n_moe * (spec.n_expert_used - 1)
        assert 0 <= misses <= picks and cached == 0  # no budget: no expert cache


def test_generation_matches_resident_with_prefetch_on_by_default(model_file):
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    ref = moestream.load(path, device="cpu", progress=False)
    want = ref.generate(PROMPT, params).tokens
    ref.close()
    e = moestream.load(path, **GATHERED)
    try:
        experts = e.experts
        assert experts.guess_width == e.spec.n_expert_used
        assert e.generate(PROMPT, params).tokens == want
        cache = e.new_cache()
        e.forward(PROMPT, cache)
        before, counted = experts.counters.bytes_moved, experts.counters.stats()
        for t in want[:4]:
            e.forward([t], cache)
        picks, _, miss_bytes, guess_bytes, _ = (b - a for a, b in zip(counted, experts.counters.stats(), strict=True))
        per_expert = sum(t.expert_bytes for t in experts.tensors.values())  # of every layer
        # each step's guesses of each layer, then its misses
        assert guess_bytes == 4 * per_expert * experts.guess_width
        assert experts.counters.bytes_moved - before == guess_bytes + miss_bytes
        assert picks == 4 * e.spec.n_layer * e.spec.n_expert_used
    finally:
        e.close()


BATCH = [PROMPT[:5], PROMPT[3:10], PROMPT[6:9]]


def decode_together(engine, prompts: list, n: int = 6) -> torch.Tensor:
    """Each prompt in its own cache, then n greedy tokens for all of them in one-pass steps (forward_each, a
    server's running batch): the steps' logits [n, B, V]."""
    caches = [engine.new_cache() for _ in prompts]
    last = [int(engine.forward(p, c)[-1].argmax()) for p, c in zip(prompts, caches, strict=True)]
    out = []
    for _ in range(n):
        out.append(engine.forward_each(last, caches))
        last = out[-1].argmax(-1).tolist()
    return torch.stack(out)


@pytest.mark.parametrize("held", [0, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-glm4moe"])
def test_a_batched_step_guesses_for_every_row_and_gives_the_unguessed_bits(model_file, preset, held):
    """Three sequences a pass (--max-seqs 3): the union of their guesses gathered ahead, picks taken from it and
    from the expert cache, the misses gathered after routing: the bits of the same passes without a guess."""
    path = model_file(preset, "Q4_K_M")
    off = moestream.load(path, prefetch=0, n_seqs=3, **GATHERED)
    want = decode_together(off, BATCH)
    off.close()
    e = moestream.load(path, n_seqs=3, expert_cache=held, **GATHERED)
    try:
        experts, spec = e.experts, e.spec
        assert experts.prefetcher.rows == 3 and experts.guess_plan(3, static=True) == experts.prefetcher.schedule()
        got = decode_together(e, BATCH)
        picks, misses, _, _, cached = experts.counters.stats()
    finally:
        e.close()
    assert torch.equal(got, want)
    assert picks == 6 * len(spec.expert_layers) * 3 * spec.n_expert_used  # every step, layer, row and pick
    assert 0 <= misses < picks, "picks were taken from the prefetched rows"
    assert (cached > 0) == bool(held)


def test_identical_rows_read_each_guessed_and_missed_expert_once(model_file):
    """Three rows stepping the same sequence pick alike: the union of their guesses is one row's, and an expert
    all three missed crosses the link once (F32: every expert of every layer the same bytes)."""
    e = moestream.load(model_file("tiny", "F32"), n_seqs=3, prefetch=1, **GATHERED)
    try:
        experts = e.experts
        got = decode_together(e, [PROMPT] * 3, 4)
        picks, misses, miss_bytes, guess_bytes, _ = experts.counters.stats()
        expert_bytes = experts.tensors[0].expert_bytes
    finally:
        e.close()
    assert all(torch.equal(got[:, 0], got[:, i]) for i in (1, 2))
    assert guess_bytes == 4 * e.spec.n_layer * expert_bytes  # one guess a layer and step, not three
    assert misses % 3 == 0 and misses > 0 and miss_bytes == misses // 3 * expert_bytes


def test_a_batch_size_reads_the_same_part_of_its_slot_every_step(model_file, monkeypatch):
    """A pass of R rows guesses a fixed number of experts (the union padded with repeats) into the same tensors
    every step, as a captured step replays; one token's pass is the R = 1 case, at the front of the slot."""
    e = moestream.load(model_file("tiny", "Q4_K_M"), n_seqs=3, **GATHERED)
    p = e.experts.prefetcher
    seen: dict[tuple[int, int], set] = {}
    queue = p.prefetch

    def probe(il, guess, *args):
        queue(il, guess, *args)
        part = p.pending[il]
        at = [(t.shape, t.data_ptr()) for t in (part.guess, part.mats, part.offs, *part.rows)]
        seen.setdefault((guess.shape[0], il), set()).add(tuple(at))

    monkeypatch.setattr(p, "prefetch", probe)
    try:
        assert [p.width(n) for n in (1, 2, 3)] == [2, 4, 6]  # tiny: 2 guessed a row, 8 experts a layer
        decode_together(e, BATCH, 4)
        decode_together(e, BATCH[:2], 4)
        decode(e, 4)
    finally:
        e.close()
    assert sorted(seen) == [(n, il) for n in (1, 2, 3) for il in range(e.spec.n_layer)]
    for (n, _), parts in seen.items():
        assert len(parts) == 1, f"{n} rows: one part of the slot every step"
        (guess, mats, *_), *_ = parts
        assert guess[0] == (p.width(n),) and mats[0] == (n * e.spec.n_expert_used,)


def watch(p, monkeypatch) -> tuple[list[str], list[int]]:
    """Record a prefetcher's guesses and takes in order ("guess2", "take0"), and for each take the picks its
    layer's guess did not name."""
    events, missed, guessed = [], [], {}
    queue, take = p.prefetch, p.take

    def probe(il, guess, *args):
        events.append(f"guess{il}")
        guessed[il] = set(guess.reshape(-1).tolist())
        queue(il, guess, *args)

    def taken(il, ids, *args):
        events.append(f"take{il}")
        missed.append(sum(int(x) not in guessed[il] for x in ids.reshape(-1)))
        return take(il, ids, *args)

    monkeypatch.setattr(p, "prefetch", probe)
    monkeypatch.setattr(p, "take", taken)
    return events, missed


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_two_layers_ahead_gives_the_resident_tokens_and_counts_misses_of_the_picks(model_file, preset, monkeypatch):
    """--prefetch-ahead 2 over 4 streamed layers: the first two guessed before layer 0 (from the embedding), the
    others at the start of the streamed layer two before, into a ring of three slots. One sequence and three a
    pass give the bits of passes without a guess (and of ahead 1), one sequence the all-resident tokens; every
    pick is counted, a miss being a pick the guess made that far ahead did not name."""
    path = model_file(preset, "Q4_K_M", layers=4)
    ref = moestream.load(path, device="cpu", progress=False)
    resident = decode(ref)[0]
    ref.close()
    off = moestream.load(path, prefetch=0, n_seqs=3, **GATHERED)
    want, together = decode(off), decode_together(off, BATCH)
    off.close()
    assert want[0] == resident
    steps = {
        1: "guess0 guess1 take0 guess2 take1 guess3 take2 take3",
        2: "guess0 guess1 guess2 take0 guess3 take1 take2 take3",
    }
    for ahead, at in ((1, {-1: [0], 0: [1], 1: [2], 2: [3]}), (2, {-1: [0, 1], 0: [2], 1: [3]})):
        e = moestream.load(path, prefetch_ahead=ahead, n_seqs=3, **GATHERED)
        p, spec = e.experts.prefetcher, e.spec
        assert p.schedule() == at and len(p.slots) == ahead + 1 and e.experts.guess_ahead == ahead
        events, missed = watch(p, monkeypatch)
        try:
            tokens, logits = decode(e)
            got = decode_together(e, BATCH)
            picks, misses, *_ = e.experts.counters.stats()
        finally:
            e.close()
        assert tokens == resident and torch.equal(logits, want[1]) and torch.equal(got, together)
        assert " ".join(events[:8]) == steps[ahead]  # the first decode step's
        assert picks == (10 + 6 * 3) * spec.n_layer * spec.n_expert_used  # every step, layer, row and pick
        assert misses == sum(missed) and 0 <= misses < picks  # the counters' misses: picks the guess did not name


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("lead", ["layer", "streamed"])
@pytest.mark.parametrize("n_cpu_moe", [1, 2])
def test_a_spread_placement_guesses_across_resident_layers(model_file, n_cpu_moe, lead, ahead, monkeypatch):
    """tiny-odd's 3 layers with 1 or 2 streamed, spread: guesses for a layer after a resident one (made there,
    or at the streamed layer before it; at 2 ahead, two layers or streamed layers before), and for layer 0 from
    the embedding; the all-resident model's tokens."""
    monkeypatch.setattr(prefetch, "LEAD", lead)
    path = model_file("tiny-odd", "Q4_K_M")
    ref = moestream.load(path, device="cpu", progress=False)
    want = decode(ref)[0]
    ref.close()
    e = moestream.load(path, **(GATHERED | dict(n_cpu_moe=n_cpu_moe, streamed_layers="spread", prefetch_ahead=ahead)))
    try:
        streamed = e.offload.placement.streamed
        assert sorted(e.experts.prefetcher.ring) == streamed
        if lead == "layer":
            plan = {max(s - ahead, -1): [s] for s in streamed}
        elif ahead == 1:
            plan = {a: [s] for a, s in zip([streamed[0] - 1, *streamed[:-1]], streamed, strict=True)}
        else:  # both from the first one's input
            plan = {streamed[0] - 1: streamed}
        assert e.experts.prefetcher.schedule() == plan
        assert decode(e)[0] == want
        assert e.experts.counters.stats()[0] == 10 * n_cpu_moe * e.spec.n_expert_used
    finally:
        e.close()


def test_only_gathered_one_token_static_passes_guess(model_file):
    path = model_file("tiny", "Q4_K_M")
    e = moestream.load(path, device="cpu", n_cpu_moe="all", small_batch="upload", progress=False)
    assert e.experts.prefetcher is None and e.experts.guess_plan(1, static=True) == {}
    e.close()
    e = moestream.load(path, **GATHERED)
    try:
        experts = e.experts
        assert experts.guess_plan(1, static=False) == {}  # outside a static pass
        assert experts.guess_plan(1, static=True) == {il - 1: [il] for il in range(e.spec.n_layer)}
        assert experts.guess_plan(2, static=True) == {}
    finally:
        e.close()
    e = moestream.load(path, stream_min_batch=1, **GATHERED)  # one-token steps upload whole layers
    try:
        decode(e, 3)
        assert e.experts.counters.stats() == (0, 0, 0, 0, 0) and not e.experts.prefetcher.pending
        assert e.experts.guess_plan(1, static=True) == {}
    finally:
        e.close()


def test_the_guess_ring_is_budgeted_as_allocated_and_only_when_layers_stream(model_file):
    e = moestream.load(model_file("tiny", "Q4_K_M"), **GATHERED)
    try:
        p, fp = e.experts.prefetcher, e.offload.footprint
        allocated = sum(buf.numel() for slot in p.slots for buf in slot.bufs)
        assert fp.prefetch == allocated == ring_bytes(p.tensors, p.tensors, p.n_guess, p.n_used) > 0
    finally:
        e.close()
    e = moestream.load(model_file("tiny", "Q4_K_M"), n_seqs=5, **GATHERED)  # 3 rows: 4 would pick all 8 experts
    try:
        p, fp = e.experts.prefetcher, e.offload.footprint
        allocated = sum(buf.numel() for slot in p.slots for buf in slot.bufs)
        assert p.rows == 3 and fp.prefetch == allocated == ring_bytes(p.tensors, p.tensors, 2, 2, rows=3)
        assert "guessed ahead for each of up to 3 sequences a pass" in e.offload.describe()
        assert allocated == 2 * (6 + 6) * sum(prefetch.stack_sizes(p.tensors, p.tensors))  # 6 guessed, 6 picks
    finally:
        e.close()
    e = moestream.load(model_file("tiny", "Q4_K_M"), prefetch_ahead=2, **GATHERED)  # a third slot
    try:
        p, fp = e.experts.prefetcher, e.offload.footprint
        allocated = sum(buf.numel() for slot in p.slots for buf in slot.bufs)
        assert fp.prefetch == allocated == ring_bytes(p.tensors, p.tensors, 2, 2, ahead=2)
        assert allocated == 3 * (2 + 2) * sum(prefetch.stack_sizes(p.tensors, p.tensors))
        assert "guessed 2 streamed layers ahead and gathered" in e.offload.describe()
    finally:
        e.close()
    fp = Footprint(dense=100, kv_cache=10, workspace=1, prefetch=5000)
    assert Placement(0, [8000, 8000], n_slots=1).gpu_bytes(fp) == 111 + 16000
    assert Placement(1, [8000, 8000], n_slots=1).gpu_bytes(fp) == 111 + 8000 + 8000 + 5000


def test_bad_widths_are_refused(model_file):
    with pytest.raises(MoestreamError, match="--prefetch -1"):
        Options.make(prefetch=-1)
    for ahead in (0, 3):
        with pytest.raises(MoestreamError, match=f"--prefetch-ahead {ahead}: give 1 .* or 2"):
            Options.make(prefetch_ahead=ahead)
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


@pytest.mark.parametrize("width", [1, 2])
def test_the_expert_cache_is_read_and_changes_no_bit(model_file, width):
    """Held experts come from the cache's rows (a wrong row shows as other logits), picks they serve cross no
    link, and the cache holds each layer's most-picked experts after a refresh."""
    path = model_file("tiny", "Q4_K_M")
    off = moestream.load(path, prefetch=0, **GATHERED)
    want = decode(off, 12)
    off.close()
    e = moestream.load(path, prefetch=width, expert_cache=3, cache_policy="static", **GATHERED)
    try:
        experts = e.experts
        cache = experts.prefetcher.cache
        assert experts.cached_width == 3 and "3 of each held on the GPU" in e.offload.describe()
        tokens, logits = decode(e, 12)
        assert tokens == want[0] and torch.equal(logits, want[1])
        picks, misses, miss_bytes, guess_bytes, cached = experts.counters.stats()
        sizes = {il: t.expert_bytes for il, t in experts.tensors.items()}
        assert picks == 12 * e.spec.n_layer * e.spec.n_expert_used and 0 < cached < picks
        assert miss_bytes <= misses * max(sizes.values()) and guess_bytes < 12 * width * sum(sizes.values())
        cache.refresh()
        for i, il in enumerate(cache.layers):
            held = cache.expert_of[i].tolist()
            freq = cache.freq[i]
            assert sorted(held) == sorted(set(held)) and min(freq[held]) >= max(
                freq[[x for x in range(8) if x not in held]]
            )
            for s, raw in enumerate(experts.tensors[il].host_bytes()):
                assert torch.equal(cache.stacks[il][s], raw[held])  # the file's bytes
        cache.stacks[cache.layers[0]][0].zero_()  # a cache that lies must be caught
        assert not torch.equal(decode(e, 12)[1], want[1])
    finally:
        e.close()


def test_the_expert_cache_is_sized_by_the_budget_and_refused_past_it(model_file):
    path = model_file("tiny", "Q4_K_M")
    e = moestream.load(path, **GATHERED)
    try:
        assert e.experts.cached_width == 0  # auto without a budget: none
        fp, p = e.offload.footprint, e.offload.placement
        sizes = [t.expert_bytes for t in e.experts.tensors.values()]
        per = len(p.streamed) * max(sizes)
        budget = p.gpu_bytes(fp) + CACHE_SLACK + 5 * per + per // 2
        assert cached_experts("auto", p, fp, budget, sizes, 8) == 5
        assert cached_experts("auto", p, fp, budget, sizes, 4) == 4  # all a layer has
        assert cached_experts(4, p, fp, budget, sizes, 8) == 4
        assert cached_experts(8, p, fp, p.gpu_bytes(fp) + 8 * per, sizes, 8) == 8  # all fit: no error
        with pytest.raises(MoestreamError, match="--expert-cache 7 needs .* room for 5 experts a streamed layer"):
            cached_experts(7, p, fp, p.gpu_bytes(fp) + 5 * per, sizes, 8)
        assert cached_experts("auto", Placement(0, [8000], n_slots=1), fp, budget, [], 8) == 0  # none gathered
    finally:
        e.close()
    with pytest.raises(MoestreamError, match="--expert-cache 99: the model has 8 experts a layer"):
        moestream.load(path, expert_cache=99, **GATHERED)  # more than a layer has (it was all of them)
    held = moestream.load(path, expert_cache=8, **GATHERED)
    try:
        assert held.experts.cached_width == held.spec.n_expert
        assert held.offload.footprint.expert_cache == held.experts.prefetcher.cache.nbytes > 0
    finally:
        held.close()
    for bad, says in (("-1", "must be 0"), ("lots", "expected an expert count or auto")):
        with pytest.raises(MoestreamError, match=f"--expert-cache {bad}: {says}"):
            Options.make(expert_cache=bad)


def test_an_auto_cache_holds_the_room_of_sequences_not_yet_made(model_file):
    """--max-seqs 4 under a budget: the auto expert cache is sized beside the KV caches alive, not beside all
    four whole ones, again as each is made (whole ones, or a server's sized to its requests; the budget holds at
    every size; the GPU server's one client had 2 experts a layer cached instead of 13), its steps captured
    again; tokens stay those of no cache."""
    path, seqs = model_file("tiny", "Q4_K_M"), dict(n_seqs=4, n_ctx=384, **GATHERED)
    e = moestream.load(path, expert_cache=0, **seqs)
    try:
        fp, p = e.offload.footprint, e.offload.placement
        sizes = [t.expert_bytes for t in e.experts.tensors.values()]
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        want = e.generate(list(range(5, 13)), greedy).tokens
    finally:
        e.close()
    per, each = len(p.streamed) * max(sizes), fp.kv_cache // 4
    budget = p.gpu_bytes(fp) + CACHE_SLACK + per + per // 2  # one row a layer beside all four KV caches
    rows = cache_rows("auto", p, fp, budget, sizes, 8)
    by_count = [rows(k * each) for k in (1, 2, 3, 4)]
    at = [cached_experts("auto", p, replace(fp, kv_cache=k * each), budget, sizes, 8) for k in (1, 2, 3, 4)]
    assert by_count == at
    assert by_count[0] == 8 and by_count[-1] == 1 and by_count == sorted(by_count, reverse=True)
    assert len(set(by_count)) == 4 and rows(0) == 8 and rows(10 * fp.kv_cache) == 1  # never past the budget
    assert cache_rows(3, p, fp, budget, sizes, 8)(0) == 3  # an asked count is the user's
    assert cache_rows("auto", p, fp, p.gpu_bytes(fp) + CACHE_SLACK, sizes, 8)(0) == 0  # none with all four
    e = moestream.load(path, vram_budget=budget, **seqs)
    try:
        cache = e.experts.prefetcher.cache
        assert cache.n == 8 and e.offload.footprint.expert_cache == cache.nbytes // 8 * 1  # budgeted with all four
        assert "8 of each held on the GPU" in e.offload.describe()
        assert "down to 1 as sequences' KV caches take the room budgeted for them" in e.offload.describe()
        assert e.generate(list(range(5, 13)), greedy).tokens == want  # generate's own cache: a whole one
        assert e.experts.cached_width == 8 and int(cache.admitted) > 0
        held = [e.new_cache() for _ in range(3)]  # three more whole ones
        assert e.experts.cached_width == by_count[3] == cache.n and not e.step.graphs
        for stacks in cache.stacks.values():
            assert all(s.shape[0] == by_count[3] for s in stacks)
        for i, il in enumerate(cache.layers):  # what it still holds is the file's bytes, mapped both ways
            kept = cache.expert_of[i]
            assert ((cache.slot_of[i] >= 0).sum() == (kept >= 0).sum()) and kept.numel() == by_count[3]
            for r, expert in enumerate(kept.tolist()):
                if expert >= 0:
                    assert int(cache.slot_of[i, expert]) == r
                    for s, raw in enumerate(e.experts.tensors[il].host_bytes()):
                        assert torch.equal(cache.stacks[il][s][r], raw[expert])
        assert e.generate(list(range(5, 13)), greedy).tokens == want
        del held
        e.new_cache()  # two whole ones alive again: it grows back (new rows empty, the kept ones in place)
        assert cache.n == by_count[1] and all(s.shape[0] == by_count[1] for s in cache.stacks[cache.layers[0]])
        assert int((cache.expert_of[:, by_count[3] :] >= 0).sum()) == 0
        assert e.generate(list(range(5, 13)), greedy).tokens == want
    finally:
        e.close()
    e = moestream.load(path, vram_budget=budget, **seqs)
    try:
        cache, setup = e.experts.prefetcher.cache, e.setup
        small = [e.new_cache(40) for _ in range(3)]  # a server's: 40 positions asked, the first key bucket given
        assert [c.kv.n_ctx for c in small] == [256] * 3 and setup.capacity(None) == 384 == setup.capacity(300)
        held = sum(setup._bytes(c.kv.n_ctx) for c in small)
        assert held == 3 * (each - e.offload.footprint.kv_cache // 4 + setup._bytes(256)) < 3 * each
        assert cache.n == rows(held) and by_count[2] < cache.n < 8  # more than three whole ones would leave
        with pytest.raises(MoestreamError, match="needs 257 positions but the context is 256"):
            e.forward(list(range(257)), small[0])
    finally:
        e.close()


def test_a_cache_asked_without_guesses_is_said_to_hold_nothing(model_file):
    with pytest.warns(UserWarning, match="--expert-cache 3: .* no experts are held"):
        e = moestream.load(model_file("tiny", "Q4_K_M"), expert_cache=3, **(GATHERED | dict(prefetch=0)))
    try:
        assert e.experts.cached_width == 0
    finally:
        e.close()


def test_a_refresh_stopped_half_way_names_no_row_for_an_expert_it_lost(model_file, monkeypatch):
    """The map drops the rows about to be rewritten before any is copied: an error between the copies leaves
    rows either unnamed or holding what the map says. A refresh before any pick copies nothing."""
    e = moestream.load(model_file("tiny", "Q4_K_M"), expert_cache=3, cache_policy="static", **GATHERED)
    try:
        cache = e.experts.prefetcher.cache
        assert cache.refresh() == 0 and cache.expert_of.tolist() == [[-1] * 3] * len(cache.layers)  # no picks yet
        decode(e, 6)
        cache.freq.zero_()
        cache.freq[:, 5:] = 7  # every layer now wants experts 5, 6, 7
        calls = []

        def fail_second(raw, ids, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return e.experts.pick.__class__.__call__(e.experts.pick, raw, ids, **kw)

        monkeypatch.setattr(cache, "pick", fail_second)
        with pytest.raises(KeyboardInterrupt):
            cache.refresh()
        monkeypatch.undo()
        for i, il in enumerate(cache.layers):
            for s, raw in enumerate(e.experts.tensors[il].host_bytes()):
                for expert, row in enumerate(cache.slot_of[i].tolist()):
                    if row >= 0:  # whatever the map names is what the row holds
                        assert torch.equal(cache.stacks[il][s][row], raw[expert])
        before = cache.moved
        assert cache.refresh() > 0 and cache.moved > before
        assert all(sorted(h) == [5, 6, 7] for h in cache.expert_of.tolist())
    finally:
        e.close()
