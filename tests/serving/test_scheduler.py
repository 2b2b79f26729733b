"""The scheduler thread: a failing request leaves the others alone; stopping drains every sequence."""

from __future__ import annotations

import queue
import warnings
import weakref

import pytest
import torch

import moestream
from moestream.runtime.sampling import SamplingParams
from moestream.serving.scheduler import Event, Mode, QueueFull, Request, Scheduler, _error


def collect(tokens: list[int], max_tokens: int = 8) -> tuple[Request, queue.Queue]:
    events: queue.Queue[Event] = queue.Queue()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_at_eos=False)
    return Request(tokens, params, events.put), events


def drain(events: queue.Queue) -> list[Event]:
    out = [events.get(timeout=30)]
    while out[-1].kind == "text":
        out.append(events.get(timeout=30))
    return out


def test_an_error_in_one_request_leaves_the_others_going(model_file):
    engine = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False, ubatch=4)
    want = engine.generate([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=8, stop_at_eos=False)).text
    s = Scheduler(engine, max_seqs=2)
    try:
        good, good_events = collect([5, 6, 7, 8, 9, 10])
        bad, bad_events = collect([5, 10**9])  # a token id the model does not have
        s.submit(bad)
        s.submit(good)
        failed, done = drain(bad_events), drain(good_events)
        assert failed[-1].kind == "error" and "token ids" in failed[-1].text
        assert done[-1].kind == "done" and done[-1].completion_tokens == 8
        assert "".join(e.text for e in done[:-1]) == want
        assert s.stats.failed == 1 and not s.running
    finally:
        s.stop()
        engine.close()


def test_stop_ends_running_sequences_and_the_thread(model_file):
    engine = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    s = Scheduler(engine, max_seqs=1)
    long, events = collect([5, 6, 7], max_tokens=4000)
    waiting, waiting_events = collect([8, 9], max_tokens=4)
    s.submit(long)
    s.submit(waiting)
    assert events.get(timeout=30).kind == "text"  # under way
    cache = weakref.ref(s.running[0].cache)
    s.stop()
    assert not s._thread.is_alive() and not s.running
    assert cache() is None, "a stopped server frees its caches (another on the same engine makes its own)"
    with pytest.raises(QueueFull, match="shutting down"):
        s.submit(collect([5], max_tokens=1)[0])
    assert drain(events)[-1].text == "the server is shutting down"
    assert drain(waiting_events)[-1].text == "the server is shutting down"
    engine.close()


def test_sequences_stepped_together_or_alone_give_their_lone_answers(model_file):
    """The load test's baseline (batched=False: each decoding sequence its own pass) and the batched pass
    serve the same greedy text, each that of the request generated alone."""
    engine = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_tokens=10, stop_at_eos=False)
    want = [engine.generate(p, params).text for p in prompts]
    try:
        for batched in (True, False, None):
            s = Scheduler(engine, max_seqs=3, batched=batched)
            try:
                runs = [collect(p, max_tokens=10) for p in prompts]
                for req, _ in runs:
                    s.submit(req)
                got = ["".join(e.text for e in drain(events)[:-1]) for _, events in runs]
            finally:
                s.stop()
            assert got == want, batched
            turns = (s.stats.batched_turns, s.stats.alone_turns)
            if batched is None:  # the measured choice tried both ways
                assert min(turns) >= 2, turns
            else:
                assert turns[batched] == 0 < turns[not batched], turns
    finally:
        engine.close()


def test_the_faster_way_is_kept_and_the_slower_retried_now_and_then():
    mode = Mode(explore=4)
    tried = []
    for _ in range(4):  # each way twice first; the first of each is warm-up, not counted
        alone = mode.alone(3)
        tried.append(alone)
        mode.record(alone, 3, 0.010 if alone else 0.004)
    assert tried == [False, True, False, True]
    picks = [mode.alone(3) for _ in range(8)]
    assert picks == [False, False, False, True, False, False, False, True]  # one pass is faster; alone retried
    for _ in range(6):  # alone became much faster: its smoothed cost follows
        mode.record(True, 3, 0.001)
    assert mode.alone(3) and mode.alone(2) is False  # another row count is measured on its own


def test_out_of_memory_is_told_with_what_to_change():
    """torch's message is a paragraph about its allocator; the client reads which flags to change."""
    oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "127.03 GiB is free. Including non-PyTorch memory, this process has 12.74 GiB memory in use."
    )
    text = _error(oom).text
    assert text.startswith("out of memory (tried to allocate 20.00 MiB): this request failed")
    assert "--max-seqs" in text and "--vram-budget" in text and "GiB is free" not in text
    assert _error(ValueError("bad\nsecond line")).text == "bad"


def test_a_server_holding_more_sequences_than_budgeted_says_so(model_file):
    path = model_file("tiny", "F32")
    for n_seqs, warns in ((1, True), (4, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # --vram-budget on the CPU device warns of its own
            engine = moestream.load(path, device="cpu", progress=False, vram_budget="8GiB", n_seqs=n_seqs)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                Scheduler(engine, max_seqs=4).stop()
            said = [str(w.message) for w in seen if "sequence(s)" in str(w.message)]
            assert bool(said) == warns and all("n_seqs=4" in s for s in said)
        finally:
            engine.close()


def test_a_way_that_fails_is_left_for_the_other(model_file, monkeypatch):
    """A pass of several rows that runs out of memory fails its requests once; after that the measured choice
    steps each sequence alone (a failing pass ends fast, and must not look fast)."""
    engine = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    each = type(engine).forward_each

    def no_room_for_several(self, tokens, caches):
        if len(tokens) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (test)")
        return each(self, tokens, caches)

    monkeypatch.setattr(type(engine), "forward_each", no_room_for_several)
    s = Scheduler(engine, max_seqs=3)
    try:
        for _ in range(6):  # rounds of three requests decoding together (two or three at a time)
            runs = [collect(p, max_tokens=8) for p in ([5, 6], [7, 8, 9], [10])]
            for req, _ in runs:
                s.submit(req)
            if all(drain(events)[-1].kind == "done" for _, events in runs):
                break
        else:
            raise AssertionError("every round had failures: the failing way was chosen again")
        assert 0 < s.stats.failed <= 5, "one failed pass of three rows, and at most one of two"
        assert s.stats.alone_turns > 0
    finally:
        s.stop()
        engine.close()


class Calls:
    """engine.forward spied on: the token count of each prompt chunk it ran (one-token steps left out)."""

    def __init__(self, engine, monkeypatch):
        self.sizes, forward = [], engine.forward

        def spy(tokens, cache, **kw):
            if len(tokens) > 1:
                self.sizes.append(len(tokens))
            return forward(tokens, cache, **kw)

        monkeypatch.setattr(engine, "forward", spy)


def test_a_prompt_alone_runs_in_one_call_and_answers_as_generate(model_file, monkeypatch):
    """Each call streams every streamed layer once: a lone prompt of 3.5 micro-batches is one call, not four."""
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, ubatch=16, n_cpu_moe="all")
    prompt = [(7 * t) % 900 + 3 for t in range(56)]
    want = engine.generate(prompt, SamplingParams(max_tokens=6, stop_at_eos=False)).text
    calls = Calls(engine, monkeypatch)
    s = Scheduler(engine, max_seqs=2)
    try:
        req, events = collect(prompt, max_tokens=6)
        s.submit(req)
        done = drain(events)
        assert "".join(e.text for e in done[:-1]) == want and calls.sizes == [56]
    finally:
        s.stop()
        engine.close()


def test_a_prompt_beside_a_decoding_sequence_runs_a_few_micro_batches_a_turn(model_file, monkeypatch):
    from moestream.serving import scheduler

    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, ubatch=8)
    long_prompt = [(5 * t) % 900 + 3 for t in range(8 * scheduler.PREFILL_UBATCHES_SHARED * 3 + 5)]
    want = engine.generate(long_prompt, SamplingParams(max_tokens=4, stop_at_eos=False)).text
    calls = Calls(engine, monkeypatch)
    s = Scheduler(engine, max_seqs=2)
    try:
        first, first_events = collect([5, 6, 7], max_tokens=400)  # decoding while the long prompt arrives
        s.submit(first)
        first_events.get(timeout=30)  # its first token: it decodes now
        req, events = collect(long_prompt, max_tokens=4)
        s.submit(req)
        done = drain(events)
        first.cancelled.set()
        assert "".join(e.text for e in done[:-1]) == want
        chunk = 8 * scheduler.PREFILL_UBATCHES_SHARED
        assert calls.sizes[0] == 3 and calls.sizes[1:] == [chunk, chunk, chunk, 5]
    finally:
        s.stop()
        engine.close()


def test_a_recurrent_prompt_stops_a_chunk_where_a_resent_one_starts(model_file, monkeypatch):
    """qwen35moe's delta-net state is copied only between calls: the chunk ends at the last micro-batch boundary
    before the prompt's end, and the same prompt sent again starts there."""
    engine = moestream.load(model_file("tiny-qwen35moe", "Q4_K_M"), device="cpu", progress=False, ubatch=16)
    prompt = [(3 * t) % 900 + 3 for t in range(40)]
    calls = Calls(engine, monkeypatch)
    s = Scheduler(engine, max_seqs=1)
    try:
        answers = []
        for _ in range(2):
            req, events = collect(prompt, max_tokens=4)
            s.submit(req)
            done = drain(events)
            answers.append(("".join(e.text for e in done[:-1]), done[-1].cached_tokens))
        assert answers[0][1] == 0 and answers[1] == (answers[0][0], 32)
        assert calls.sizes == [32, 8, 8]  # the second run starts at 32: its 8 tokens are one chunk
    finally:
        s.stop()
        engine.close()


def test_requests_one_at_a_time_leave_the_expert_cache_its_room(model_file):
    """--max-seqs 3 under a budget: each request's KV cache holds its prompt and max_tokens (a key bucket), not
    the whole context; requests one after another reuse the free cache (what it held goes to host RAM, and comes
    back for a request sharing it) where a new one would shrink the auto expert cache; requests at once get a
    cache each, their room taken from the expert cache; a request that no free cache holds gets a larger one in
    the place of one."""
    from moestream.offload.placement import CACHE_SLACK

    path = model_file("tiny", "Q4_K_M")
    opts = dict(device="cpu", progress=False, n_cpu_moe="all", small_batch="gather", n_seqs=3, n_ctx=384, ubatch=4)
    probe = moestream.load(path, expert_cache=0, **opts)
    fp, p = probe.offload.footprint, probe.offload.placement
    per = len(p.streamed) * max(t.expert_bytes for t in probe.experts.tensors.values())
    probe.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --vram-budget on the CPU device
        engine = moestream.load(path, vram_budget=p.gpu_bytes(fp) + CACHE_SLACK + per, **opts)
    s = Scheduler(engine, max_seqs=3)
    cache, setup = engine.experts.prefetcher.cache, engine.setup
    try:
        whole = engine.experts.cached_width  # beside a whole KV cache, before any request
        for prompt in ([5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [5, 6, 7, 8, 9, 10, 11, 12, 13]):
            req, events = collect(prompt, max_tokens=4)
            s.submit(req)
            assert drain(events)[-1].kind == "done"
        assert [c.kv.n_ctx for c in setup.caches] == [256]  # reused: a second would shrink the expert cache
        assert engine.experts.cached_width == cache.rows_for(setup.kv_bytes()) > whole  # a small one leaves it more
        assert s.prompts.stats.host_hits == 1  # the third took the first's prefix back from host RAM
        together = [collect([30 + i, 31, 32], max_tokens=40) for i in range(3)]
        for req, _ in together:
            s.submit(req)
        for _, events in together:
            assert drain(events)[-1].kind == "done"
        assert sorted(c.kv.n_ctx for c in setup.caches) == [256] * 3
        assert engine.experts.cached_width == cache.rows_for(setup.kv_bytes()) > cache.rows_for(fp.kv_cache)
        long, events = collect(list(range(40, 340)), max_tokens=8)  # 308 positions: no free cache holds it
        s.submit(long)
        assert drain(events)[-1].kind == "done"
        assert sorted(c.kv.n_ctx for c in setup.caches) == [256, 256, 384]
        assert engine.experts.cached_width == cache.rows_for(setup.kv_bytes())
    finally:
        s.stop()
        engine.close()
