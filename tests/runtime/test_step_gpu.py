"""Decode steps replayed from CUDA graphs: the eager steps' bits, streamed or resident, and the bytes they read."""

from __future__ import annotations

import warnings

import pytest
import torch

import moestream
from moestream.kernels import launch, tuning
from moestream.offload.placement import CACHE_SLACK
from moestream.profiling.timeline import NULL, Timeline
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.step import DecodeStep

pytestmark = pytest.mark.gpu
TOKENS = torch.randint(0, 1280, (300,), generator=torch.Generator().manual_seed(5)).tolist()


def steps(engine, tokens):
    cache = engine.new_cache()
    return torch.cat([engine.forward([t], cache) for t in tokens]), cache


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-glm4moe-odd"])
@pytest.mark.parametrize("n_cpu_moe", [0, "all"])
@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.1), ("float32", 1e-2)])
def test_replayed_steps_give_the_eager_steps_bits(model_file, preset, n_cpu_moe, dtype, tolerance):
    """Across a key bucket (256): replays equal the same static steps run eagerly (recording turns graphs off),
    and prefill's logits within the dtype's tolerance (other kernels: bf16 rounds weights, matvecs do not)."""
    path = model_file(preset, "Q4_K_M")
    e = moestream.load(path, device="cuda", dtype=dtype, progress=False, n_cpu_moe=n_cpu_moe)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused capture warns and runs eagerly: not good enough here
            graphed, cache = steps(e, TOKENS)
        assert sorted(e.step.graphs[cache].steps) == [256, 512], "steps were not captured"
        e.record(Timeline(e.device))
        eager, cache = steps(e, TOKENS)
        assert cache not in e.step.graphs
        e.record(NULL)
        ref = e.logits(TOKENS)  # prefill: other kernels, so close rather than equal
    finally:
        e.close()
    assert torch.equal(graphed, eager)
    graphed = graphed.cpu()
    assert float((graphed - ref).abs().max() / ref.abs().max()) < tolerance


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
@pytest.mark.parametrize("n_cpu_moe", [0, "all"])
def test_steps_launched_dependently_give_the_bits_of_steps_launched_in_turn(model_file, monkeypatch, preset, n_cpu_moe):
    """Programmatic dependent launch (the tuning's pdl) lets a kernel start before the one before it ends; each waits
    on the GPU before touching memory, so replayed steps, streamed ones with their side-stream gathers
    too, have the bits of steps whose kernels run strictly one after another."""
    path = model_file(preset, "Q4_K_M")
    e = moestream.load(path, device="cuda", progress=False, n_cpu_moe=n_cpu_moe)
    try:
        assert launch.pdl(torch.empty(1, device="cuda"))["PDL"] == (torch.cuda.get_device_capability() >= (9, 0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused capture warns and runs eagerly: not good enough here
            dependent, cache = steps(e, TOKENS[:40])
            assert cache in e.step.graphs
            with tuning.use(pdl=False):  # a new cache: its steps are captured anew
                in_turn, _ = steps(e, TOKENS[:40])
    finally:
        e.close()
    assert torch.equal(dependent, in_turn)


@pytest.mark.parametrize(
    "prefetch,held,ahead,policy",
    [
        (0, 0, 1, "static"),
        (None, 0, 1, "static"),
        (1, 0, 1, "static"),
        (None, 3, 1, "static"),
        (1, 3, 1, "static"),
        (None, 0, 2, "static"),
        (1, 3, 2, "static"),
        (None, 3, 1, "lru"),
        (1, 3, 2, "lfu"),
    ],
)
def test_streamed_decode_reads_the_chosen_experts_and_gives_resident_tokens(model_file, prefetch, held, ahead, policy):
    """Gathered in replayed graphs, without a guess, with the router's count guessed a layer (or two) ahead on a
    side stream, and with a one-expert guess (mostly misses, gathered after routing), with and without 3 experts
    a layer held in the expert cache (refreshed, or admitting picks in the graph): resident tokens each time."""
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    ref = moestream.load(path, device="cuda", progress=False)
    got = moestream.load(
        path,
        device="cuda",
        progress=False,
        n_cpu_moe="all",
        small_batch="gather",
        prefetch=prefetch,
        prefetch_ahead=ahead,
        expert_cache=held,
        cache_policy=policy,
    )
    try:
        assert ref.generate(TOKENS[:16], params).tokens == got.generate(TOKENS[:16], params).tokens
        experts, cache = got.experts, got.new_cache()
        got.forward(TOKENS[:40], cache)  # a whole-layer upload per layer: 40 tokens >= stream_min_batch
        before, counted = experts.counters.bytes_moved, experts.counters.stats()
        held_cache = experts.prefetcher.cache if experts.prefetcher is not None else None
        refreshed = held_cache.moved if held_cache is not None else 0
        for t in TOKENS[40:60]:
            got.forward([t], cache)
        if held_cache is not None:  # what the cache's refreshes copied in is link bytes too
            refreshed = held_cache.moved - refreshed
        assert cache in got.step.graphs
        K, width = got.spec.n_expert_used, experts.guess_width
        per_expert = sum(t.nbytes // t.n_expert for t in experts.tensors.values())
        moved = experts.counters.bytes_moved - before
        if prefetch == 0:
            assert counted is None
            assert moved == 20 * per_expert * K  # replays counted: K experts a layer, no more
            return
        picks, misses, miss_bytes, guess_bytes, cached = (
            b - a for a, b in zip(counted, experts.counters.stats(), strict=True)
        )
        assert moved == guess_bytes + miss_bytes + refreshed  # the guesses and misses counted on the device
        assert picks == 20 * got.spec.n_layer * K and 0 <= misses <= picks
        sizes = [t.nbytes // t.n_expert for t in experts.tensors.values()]  # Q4_K_M: some layers' down is Q6_K
        if held:  # held experts cross no link, guessed or missed
            assert experts.cached_width == held and 0 < cached < picks
            assert (int(held_cache.admitted) > 0) == (policy != "static") and (refreshed == 0 or policy == "static")
            assert guess_bytes < 20 * per_expert * width and miss_bytes <= misses * max(sizes)
        else:
            assert cached == 0 and guess_bytes == 20 * per_expert * width
            assert misses * min(sizes) <= miss_bytes <= misses * max(sizes)
        if prefetch == 1:
            assert misses >= 20 * got.spec.n_layer * (K - 1)
    finally:
        ref.close()
        got.close()


def test_a_capture_that_fails_half_way_leaves_eager_steps_that_work(model_file, monkeypatch):
    """Events recorded inside a failed capture never ran: the streamer and the prefetcher forget them, and the
    steps after it (eager from then on) give the tokens of an engine whose captures worked."""
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    opts = dict(device="cuda", progress=False, n_cpu_moe="all", small_batch="gather")
    ref = moestream.load(path, **opts)
    want = ref.generate(TOKENS[:40], params).tokens
    ref.close()
    e = moestream.load(path, **opts)
    layers = DecodeStep._layers

    def failing(self, *args):
        out = layers(self, *args)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a capture refused half-way (test)")
        return out

    monkeypatch.setattr(DecodeStep, "_layers", failing)
    try:
        with pytest.warns(UserWarning, match="could not be captured"):
            got = e.generate(TOKENS[:40], params).tokens  # 40 tokens: the prompt streams whole layers first
        assert not e.setup.capturing.one and got == want
    finally:
        e.close()


def _step_together(e, prompts: list, n_steps: int):
    """Each prompt prefilled in its own cache, then n_steps greedy tokens for all of them through forward_each.
    Returns the logits [n_steps, B, V], the tokens fed at each step, and the caches (their graphs live on)."""
    caches = [e.new_cache() for _ in prompts]
    last = [int(e.forward(p, c)[-1].argmax()) for p, c in zip(prompts, caches, strict=True)]
    fed, out = [], []
    for _ in range(n_steps):
        fed.append(last)
        out.append(e.forward_each(last, caches))
        last = [int(row.argmax()) for row in out[-1]]
    return torch.stack(out), fed, caches


def _stepped_alone(e, prompt: list, fed: list, i: int) -> torch.Tensor:
    """Row i's tokens of fed, after its prompt, stepped alone in a fresh cache: logits [n_steps, V]."""
    cache = e.new_cache()
    e.forward(prompt, cache)
    return torch.cat([e.forward([step[i]], cache) for step in fed])


@pytest.mark.parametrize(("preset", "n_cpu_moe"), [("tiny", 0), ("tiny", "all"), ("tiny-qwen35moe", 0)])
def test_batched_steps_replay_the_eager_batch_and_each_sequence_alone(model_file, preset, n_cpu_moe):
    """A server's running batch (forward_each), captured once for its caches: replays equal the same batch run
    eagerly, and each row's logits those of its sequence stepped alone on the same tokens."""
    path = model_file(preset, "Q4_K_M")
    e = moestream.load(path, device="cuda", dtype="float32", progress=False, n_cpu_moe=n_cpu_moe)
    prompts = [TOKENS[:5], TOKENS[10:17], TOKENS[30:33]]
    try:
        assert e.step.replays(len(prompts))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused capture warns and runs eagerly: not good enough here
            graphed, fed, caches = _step_together(e, prompts, 10)
        assert len(e.step.batch_graphs.steps) == 1, "one set of caches in one key bucket: one capture"
        del caches
        assert not e.step.batch_graphs.steps, "freed caches take their graphs along"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # new caches capture again (a server's next run after a stop)
            again, _, _ = _step_together(e, prompts, 10)
        assert torch.equal(again, graphed) and e.step.replays(len(prompts))
        e.record(Timeline(e.device))  # recording runs every pass eagerly
        eager, _, _ = _step_together(e, prompts, 10)
        e.record(NULL)
        assert torch.equal(graphed, eager)
        for i, prompt in enumerate(prompts):
            alone = _stepped_alone(e, prompt, fed, i)
            assert float((alone - graphed[:, i]).abs().max() / alone.abs().max()) < 1e-3
    finally:
        e.close()


@pytest.mark.parametrize(
    ("preset", "n_cpu_moe"),
    [("tiny", 0), ("tiny", "all"), ("tiny-qwen35moe", 0), ("tiny-glm4moe", "all"), ("tiny-glm4moe-odd", 0)],
)
def test_a_batched_step_gives_each_row_the_bits_of_its_step_alone(model_file, preset, n_cpu_moe):
    """In bfloat16, as served: the GPU load test saw 12 of 96 greedy answers differ from the lone ones. Every
    product in a decode step is now chosen per token (quantized matvec tiles, the router, the weighted sum) and
    passes hold at most MAX_TOKENS rows (6 sequences: 4 + 2), so a row's logits equal, bit for bit, those of
    its sequence stepped alone."""
    e = moestream.load(model_file(preset, "Q4_K_M"), device="cuda", progress=False, n_cpu_moe=n_cpu_moe)
    prompts = [TOKENS[:5], TOKENS[10:17], TOKENS[30:33], TOKENS[40:49], TOKENS[50:52], TOKENS[60:66]]  # 4 + 2
    try:
        together, fed, _ = _step_together(e, prompts, 6)
        for i, prompt in enumerate(prompts):
            assert torch.equal(_stepped_alone(e, prompt, fed, i), together[:, i]), f"row {i}"
    finally:
        e.close()


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize(("held", "policy"), [(0, "static"), (3, "static"), (3, "lru")])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-glm4moe-odd"])
def test_a_batched_step_guesses_ahead_in_its_graph_and_replays_the_eager_bits(model_file, preset, held, policy, ahead):
    """Every layer's experts streamed and gathered, three sequences a pass (--max-seqs 3): the union of the rows'
    guesses gathered ahead on the side stream, picks taken from it and from the expert cache, misses read once,
    all inside one captured step. Replays equal the eager passes, the passes without a guess, and each row its
    sequence stepped alone; every row's picks are counted."""
    path = model_file(preset, "Q4_K_M")
    opts = dict(device="cuda", progress=False, n_cpu_moe="all", small_batch="gather", n_seqs=3)
    prompts = [TOKENS[:5], TOKENS[10:17], TOKENS[30:33]]
    off = moestream.load(path, prefetch=0, **opts)
    try:
        unguessed, _, _ = _step_together(off, prompts, 10)
    finally:
        off.close()
    e = moestream.load(path, expert_cache=held, cache_policy=policy, prefetch_ahead=ahead, **opts)
    try:
        experts, spec = e.experts, e.spec
        assert e.step.replays(3) and experts.guess_plan(3, static=True) == experts.prefetcher.schedule()
        counted = experts.counters.stats()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused capture warns and runs eagerly: not good enough here
            graphed, fed, _ = _step_together(e, prompts, 10)
        assert len(e.step.batch_graphs.steps) == 1, "the batch's steps replay one graph"
        picks, misses, _, _, cached = (b - a for a, b in zip(counted, experts.counters.stats(), strict=True))
        e.record(Timeline(e.device))  # recording runs every pass eagerly
        eager, _, _ = _step_together(e, prompts, 10)
        e.record(NULL)
        alone = [_stepped_alone(e, prompt, fed, i) for i, prompt in enumerate(prompts)]
    finally:
        e.close()
    assert torch.equal(graphed, eager) and torch.equal(graphed, unguessed)
    for i, row in enumerate(alone):
        assert torch.equal(row, graphed[:, i]), f"row {i}"
    assert picks == 10 * len(spec.expert_layers) * 3 * spec.n_expert_used and misses < picks
    assert (cached > 0) == bool(held)


@pytest.mark.filterwarnings("error")  # a refused capture warns and runs eagerly: not good enough here
def test_batch_graphs_go_with_their_caches_and_the_least_recently_replayed_first(model_file, monkeypatch):
    """A freed cache takes the batch steps naming it along (its id may name the next cache); past the limit the
    step replayed longest ago is dropped, not the one in use."""
    from moestream.runtime import graphs

    monkeypatch.setattr(graphs, "BATCH_GRAPHS", 2)
    e = moestream.load(model_file("tiny", "Q4_K_M"), device="cuda", progress=False)
    try:
        assert e.step.replays(2)
        a, b, c = (e.new_cache() for _ in range(3))
        for cache in (a, b, c):
            e.forward(TOKENS[:4], cache)
        e.forward_each([1, 2], [a, b])  # eager, then captured
        e.forward_each([1, 2], [b, c])
        e.forward_each([3, 4], [a, b])  # a replay: [a, b] is now the most recent
        graphs = e.step.batch_graphs
        assert len(graphs.steps) == 2
        d = e.new_cache()
        e.forward(TOKENS[:4], d)
        e.forward_each([5, 6], [c, d])  # a third: [b, c] goes, [a, b] stays
        assert {frozenset(s.names) for s in graphs.steps.values()} == {
            frozenset({id(a), id(b)}),
            frozenset({id(c), id(d)}),
        }
        del a
        assert {frozenset(s.names) for s in graphs.steps.values()} == {frozenset({id(c), id(d)})}
    finally:
        e.close()


def _greedy(engine, cache, prompt: list[int], n: int) -> list[int]:
    logits, out = engine.forward(prompt, cache), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = engine.forward([out[-1]], cache)
    return out


@pytest.mark.filterwarnings("error")  # a refused capture warns and runs eagerly: not good enough here
def test_an_expert_cache_giving_back_idle_sequences_room_keeps_each_sequences_tokens(model_file):
    """--max-seqs 3 under a budget: the auto expert cache starts with the room of the two KV caches not made
    and shrinks as they are made; the steps captured over its rows are dropped and captured again, and every
    sequence (the first one going on after each shrink) decodes the tokens it does with no cache."""
    path = model_file("tiny", "Q4_K_M")
    opts = dict(device="cuda", progress=False, n_cpu_moe="all", small_batch="gather", n_seqs=3, n_ctx=384)
    prompts = [TOKENS[:5], TOKENS[10:17], TOKENS[30:33]]

    def run(e) -> tuple[list[list[int]], list[int]]:
        caches, out, rows = [], [], []
        for prompt in prompts:
            caches.append(e.new_cache())
            rows.append(e.experts.cached_width)
            out.append(_greedy(e, caches[-1], prompt, 12))
            out.append(_greedy(e, caches[0], [out[0][-1]], 4))  # the first sequence goes on
            assert caches[0] in e.step.graphs  # captured again after a shrink
        return out, rows

    ref = moestream.load(path, expert_cache=0, **opts)
    try:
        fp, p = ref.offload.footprint, ref.offload.placement
        per = len(p.streamed) * max(t.expert_bytes for t in ref.experts.tensors.values())
        want, _ = run(ref)
    finally:
        ref.close()
    e = moestream.load(path, vram_budget=p.gpu_bytes(fp) + CACHE_SLACK + per + per // 2, cache_policy="lru", **opts)
    try:
        got, rows = run(e)
        each, cache = e.offload.footprint.kv_cache // 3, e.experts.prefetcher.cache
        assert rows == [cache.rows_for(k * each) for k in (1, 2, 3)] and rows[0] > rows[-1] >= 1
    finally:
        e.close()
    assert got == want
