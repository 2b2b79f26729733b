"""The prompt cache under the server's scheduler: a prompt that shares a prefix with an earlier one starts from it
(in place, copied from a running sequence, or back from host RAM) and gives the greedy tokens of a cold prefill."""

from __future__ import annotations

import contextlib
import queue

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.runtime.prompt_cache import Prefix, PromptCache
from moestream.runtime.sampling import SamplingParams
from moestream.serving.scheduler import Event, Request, Scheduler

UB = 4
PRESETS = ["tiny", "tiny-qwen35moe", "tiny-gpt-oss", "tiny-glm4moe"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)


def load(model_file, preset: str, **kw):
    return moestream.load(model_file(preset, "F32"), device="cpu", progress=False, ubatch=UB, n_ctx=128, **kw)


def ask(s: Scheduler, prompt: list[int], cache_prompt: bool = True) -> Event:
    """Run one request to its end; its done event (tokens as text of the event, token by token)."""
    events: queue.Queue[Event] = queue.Queue()
    s.submit(Request(prompt, GREEDY, events.put, cache_prompt=cache_prompt))
    text = ""
    while (ev := events.get(timeout=60)).kind == "text":
        text += ev.text
    assert ev.kind == "done", ev.text
    ev.text = text
    return ev


@contextlib.contextmanager
def serving(engine, **options):
    """A scheduler over engine; both closed after."""
    s = Scheduler(engine, **options)
    try:
        yield s
    finally:
        s.stop()
        engine.close()


def cold(engine, prompt: list[int]) -> str:
    return engine.generate(prompt, GREEDY).text


@pytest.mark.parametrize("preset", PRESETS)
def test_a_follow_up_reuses_its_prefix_in_place_and_answers_as_cold(model_file, preset):
    engine = load(model_file, preset)
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two whole micro-batches and a part
    follow = first + [20, 21, 22, 23, 24, 25, 26]
    other = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    want = [cold(engine, p) for p in (first, follow, other)]
    with serving(engine, max_seqs=1, cache_ram=0) as s:
        a, b, c = ask(s, first), ask(s, follow), ask(s, other)
        assert [a.text, b.text, c.text] == want
        # the rows of whole prompt micro-batches only: not the part, not the generated tokens
        assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 8, 0)
        assert (s.prompts.stats.hits, s.prompts.stats.tokens, s.prompts.stats.host_saves) == (1, 8, 0)
        assert s.stats.prompt_tokens == len(first) + len(follow) - 8 + len(other)
        d = ask(s, follow, cache_prompt=False)  # the request's own switch
        assert (d.text, d.cached_tokens) == (want[1], 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_prefix_comes_back_from_host_ram(model_file, preset):
    """One sequence cache: a different prompt overwrites it, so the first prompt's prefix is copied to host RAM
    first and copied back for its follow-up."""
    engine = load(model_file, preset)
    first = list(range(40, 53))  # 13 tokens: 12 reusable
    follow = first + [60, 61, 62]
    want = cold(engine, follow)
    with serving(engine, max_seqs=1) as s:
        ask(s, first)
        ask(s, [70, 71, 72, 73, 74, 75])
        assert s.prompts.stats.host_saves == 1 and s.prompts.host_bytes > 0
        b = ask(s, follow)
        assert (b.text, b.cached_tokens) == (want, 12)
        assert s.prompts.stats.host_hits == 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_a_running_sequence_lends_its_prefix(model_file, preset):
    """Two sequences at once: the second copies the first's prompt rows (and state) while the first decodes."""
    engine = load(model_file, preset)
    shared = list(range(100, 109))
    second = shared + [7, 8, 9]
    want = cold(engine, second)
    with serving(engine, max_seqs=2) as s:
        events: queue.Queue[Event] = queue.Queue()
        long = SamplingParams(max_tokens=100, temperature=0.0, stop_at_eos=False)
        s.submit(Request(shared, long, events.put))
        assert events.get(timeout=60).kind == "text"  # its prompt has run
        b = ask(s, second)
        assert (b.text, b.cached_tokens) == (want, 8)
        assert s.prompts.stats.host_hits == 0 and len(s._caches) + len(s.running) == 2


def test_the_host_tier_evicts_least_recently_used_within_its_budget(model_file):
    engine = load(model_file, "tiny")
    one = engine.new_cache().kv.rows(8).nbytes  # what a prefix of 8 rows keeps
    prompts = [[p + i for i in range(9)] for p in (10, 30, 50, 70)]
    with serving(engine, max_seqs=1, cache_ram=2 * one + one // 2) as s:  # room for two
        for p in prompts:
            ask(s, p)
        stats = s.prompts.stats
        assert stats.host_saves == 3 and stats.host_evictions == 1
        assert s.prompts.host_bytes == 2 * one <= s.prompts.ram_bytes
        assert ask(s, prompts[0] + [1]).cached_tokens == 0  # evicted first (and prompts[1] now, for prompts[3])
        assert ask(s, prompts[2] + [1]).cached_tokens == 8  # from host RAM
        assert s.prompts.stats.host_hits == 1
        assert s.prompts.host_bytes <= s.prompts.ram_bytes


def test_a_prefix_larger_than_the_budget_is_not_kept(model_file):
    engine = load(model_file, "tiny")
    with serving(engine, max_seqs=1, cache_ram=engine.new_cache().kv.rows(4).nbytes) as s:
        ask(s, list(range(10, 19)))
        ask(s, list(range(30, 39)))
        assert s.prompts.stats.host_saves == 0 and s.prompts.host_bytes == 0


def test_reusable_prefixes_are_whole_micro_batches_with_one_token_left():
    attention = Prefix(list(range(12)))
    assert attention.reusable(list(range(12)) + [99], 4) == 12
    assert attention.reusable(list(range(12)), 4) == 8  # the last token runs: its logits are the answer
    assert attention.reusable(list(range(7)) + [99] * 8, 4) == 4
    assert attention.reusable([99] + list(range(1, 12)), 4) == 0
    recurrent = Prefix(list(range(12)), {12: {}}, recurrent=True)  # a state only at 12: nothing before
    assert recurrent.reusable(list(range(20)), 4) == 12
    assert recurrent.reusable(list(range(11)) + [99] * 8, 4) == 0


def test_kv_rows_round_trip_through_the_cache_methods(model_file):
    engine = load(model_file, "tiny")
    a, b = engine.new_cache(), engine.new_cache()
    engine.forward(list(range(1, 9)), a)
    b.kv.copy_prefix(a.kv.rows(8, "cpu").first(6))
    for il in a.kv.k:
        assert torch.equal(b.kv.rows(6).k[il], a.kv.rows(6).k[il])
        assert torch.equal(b.kv.rows(6).v[il], a.kv.rows(6).v[il])
        assert not b.kv.rows(8).k[il][6:].any()
    with pytest.raises(MoestreamError, match="rows 0..9"):
        a.kv.rows(8).first(9)
    with pytest.raises(MoestreamError, match="--cache-ram"):
        PromptCache(UB, -5)
    engine.close()


def prefill(engine, prompts: PromptCache, cache, tokens: list[int]) -> torch.Tensor:
    """The scheduler's prefill of a lone prompt: one call of several micro-batches, ending where the prompt cache
    says (a recurrent model's last boundary), the prompt cache told after each call."""
    while tokens:
        n = prompts.chunk(cache, len(tokens))
        logits = engine.forward(tokens[:n], cache)
        prompts.prefilled(cache)
        tokens = tokens[n:]
    return logits


def by_micro_batch(engine, cache, tokens: list[int]) -> torch.Tensor:
    """A cold prefill one micro-batch a call (each call's rows equal those of one call over all)."""
    for i in range(0, len(tokens), UB):
        logits = engine.forward(tokens[i : i + UB], cache)
    return logits


def check_warm_logits(engine, first: list[int], follow: list[int]) -> None:
    """The last prompt logits of follow started from first's cached prefix equal a cold prefill's bit for bit:
    in place after decode steps moved the cache on, copied from a running cache, and back from host RAM."""
    whole = len(first) - len(first) % UB
    last = (len(follow) - 1) // UB * UB  # the same prompt again runs its last micro-batch
    want = by_micro_batch(engine, engine.new_cache(), follow)
    pc, free = PromptCache(UB), []
    cache, _ = pc.take(first, free, [], engine.new_cache)
    prefill(engine, pc, cache, first)
    for token in (1, 2, 3):  # decode steps move the KV and the recurrent state past the prefix
        engine.forward([token], cache)
    free.append(cache)
    cache, n = pc.take(follow, free, [], None)
    assert n == whole and cache.n_past == whole
    assert torch.equal(prefill(engine, pc, cache, follow[n:]), want)
    running, n = pc.take(follow, [], [cache], engine.new_cache)
    assert n == last and torch.equal(prefill(engine, pc, running, follow[n:]), want)
    free.append(cache)
    other = list(range(300, 310))
    cache, _ = pc.take(other, free, [], None)  # another prompt: the follow-up's prefix goes to host RAM
    prefill(engine, pc, cache, other)
    free.append(cache)
    cache, n = pc.take(follow, free, [], None)
    assert n == last and pc.stats.host_hits == 1
    assert torch.equal(prefill(engine, pc, cache, follow[n:]), want)


@pytest.mark.parametrize("preset", PRESETS)
def test_warm_logits_equal_cold_bit_for_bit(model_file, preset):
    engine = load(model_file, preset)
    check_warm_logits(engine, list(range(200, 211)), list(range(200, 211)) + [3, 4, 5, 6, 7])
    engine.close()


@pytest.mark.parametrize("kv", ["f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_each_kv_cache_type_answers_warm_as_cold(model_file, preset, kv):
    """-ctk/-ctv: the rows are kept as stored blocks (or another float dtype) and copied as they are, in place,
    from a running cache and back from host RAM: the same logits and greedy tokens as a cold run."""
    engine = load(model_file, preset, cache_type_k=kv, cache_type_v=kv)
    first = list(range(200, 211))
    follow = first + [3, 4, 5, 6, 7]
    want = cold(engine, follow)
    check_warm_logits(engine, first, follow)
    with serving(engine, max_seqs=1) as s:
        ask(s, first)
        ask(s, list(range(70, 79)))  # another prompt: first's prefix goes to host RAM
        b = ask(s, follow)
        assert (b.text, b.cached_tokens, s.prompts.stats.host_hits) == (want, 8, 1)


def test_a_cache_holding_nothing_is_taken_before_the_pool_grows(model_file):
    engine = load(model_file, "tiny")
    pc, grown = PromptCache(UB), []

    def grow():
        grown.append(engine.new_cache())
        return grown[-1]

    a, _ = pc.take([1, 2, 3], [], [], grow)
    prefill(engine, pc, a, [1, 2, 3])  # no whole micro-batch: nothing to keep
    b, _ = pc.take(list(range(10, 19)), [a], [], grow)
    assert b is a and len(grown) == 1
    prefill(engine, pc, b, list(range(10, 19)))  # 8 rows worth keeping
    c, _ = pc.take(list(range(30, 39)), [b], [], grow)
    assert c is not b and len(grown) == 2 and pc.stats.host_saves == 0  # a new cache: b keeps its prefix
    d, n = pc.take(list(range(10, 20)), [b], [c], None)
    assert d is b and n == 8
    engine.close()
