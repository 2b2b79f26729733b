"""The one thread that drives the engine for the server: requests queue, up to max_seqs sequences run.

A turn advances every running sequence by a step: a chunk of its prompt, or one generated token. A chunk is a few
micro-batches while other sequences decode (so a long prompt stalls them only so long) and more when none does:
each call streams every streamed layer's experts once, however many micro-batches it runs, so one micro-batch a
turn would pay a full stream for every ubatch tokens of a prompt. The decoding sequences' tokens go through
the model together (`Engine.forward_each`: one pass, the experts read once for all of them, replayed on a GPU
from a graph captured per set of caches) or each sequence alone, whichever `Mode` measured faster for that
many; alone where only a one-token step can be captured.
Each sequence has its own cache, from a pool reused across requests (with its captured steps); a new request
starts from the longest prefix it shares with an earlier one (runtime/prompt_cache.py, --cache-prompt).
"""

from __future__ import annotations

import functools
import queue
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from moestream.errors import MoestreamError, is_out_of_memory
from moestream.formats.tokenizer import TextStream
from moestream.offload.small_batch import Timings
from moestream.options import PROMPT_CACHE_RAM_MIB
from moestream.runtime.prompt_cache import PromptCache
from moestream.runtime.sampling import Constraint, NoTokenLeft, Sampler, SamplingParams, TokenLogprob

PREFILL_UBATCHES = 16  # micro-batches of a prompt a turn runs when no other sequence decodes (Ctrl-C and a client
# leaving wait for a turn to end)
PREFILL_UBATCHES_SHARED = 4  # while others decode: each of their tokens waits for the chunk


@dataclass
class Event:
    kind: str  # text | done | error
    text: str = ""
    finish_reason: str = ""  # stop | length
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prompt cache, not run
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens this text (or the end) brings
    client: bool = False  # an error the request's own fields caused (HTTP 400), not the server (500)


@dataclass
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]  # called on the scheduler thread; must not block
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True  # start from a cached prefix where there is one (llama-server's field)
    cancelled: threading.Event = field(default_factory=threading.Event)
    constraint: Constraint | None = None  # what may come next (response_format), this request's own


def _error(e: Exception) -> Event:
    """An error event: the first line of the exception, or its type when it says nothing; out of memory with
    what to change (torch's own message is a paragraph about its allocator)."""
    if is_out_of_memory(e):
        asked = re.search(r"tried to allocate ([\d.]+ \w+)", str(e), re.IGNORECASE)
        what = f" (tried to allocate {asked[1]})" if asked else ""
        return Event(
            "error",
            text=f"out of memory{what}: this request failed; restart the server with a larger --vram-budget, "
            "a smaller --max-seqs or --ctx, or more layers streamed",
        )
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return Event("error", text=text, client=isinstance(e, NoTokenLeft))


class QueueFull(MoestreamError):
    """The server cannot take the request now (HTTP 503): its queue is full, or it is shutting down."""


class Mode:
    """Whether n decoding sequences go through one pass or each alone, by which was faster at n so far.

    Which wins depends on the placement: one pass reads resident weights once for all rows and each streamed
    expert once for the rows that picked it (guessed ahead for all of them, the expert cache read), but the
    union of several rows' picks can cross the link slower than each row's alone behind its own guess. Both
    give the same tokens (each row is computed as it would be alone), so the choice is only about speed, timed
    as --small-batch auto's is (offload/small_batch.py Timings). Each way is tried twice first (the first turns
    compile and capture), and the slower one again every `explore` turns, in case the placement's balance
    moved."""

    def __init__(self, explore: int = 64, window: int = 5):
        self.explore = explore
        self.timings = Timings(warm_up=1, window=window)  # keyed (alone, n)
        self.turns: dict[int, int] = {}

    def alone(self, n: int) -> bool:
        tried = [self.timings.runs((alone, n)) for alone in (False, True)]
        if min(tried) < 2:
            return tried[1] < tried[0]
        self.turns[n] = self.turns.get(n, 0) + 1
        faster = self.timings.fastest([(False, n), (True, n)])[0]
        return not faster if self.turns[n] % self.explore == 0 else faster

    def record(self, alone: bool, n: int, seconds: float) -> None:
        self.timings.record((alone, n), seconds)

    def failed(self, alone: bool, n: int) -> None:
        """A turn this way failed (out of memory for a pass of n rows, say): the other way from now on, this
        one retried only when exploring."""
        self.timings.failed((alone, n))


@dataclass
class _Sequence:
    req: Request
    cache: object
    sampler: Sampler
    stream: TextStream | None
    pending: list[int]  # prompt tokens not yet run
    cached: int = 0  # prompt tokens the prompt cache had
    token: int | None = None  # sampled, not yet emitted
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already emitted
    # (where in text its characters start, logprob) of tokens not yet emitted (params.logprobs)
    logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)


@dataclass
class Stats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    requests: int = 0
    failed: int = 0
    picks: int = 0  # streamed layers' expert picks in decode steps that guessed ahead (--prefetch)
    guessed: int = 0  # of those, named by the guess
    held: int = 0  # of those, held in the expert cache
    batched_turns: int = 0  # decode turns of several sequences in one pass
    alone_turns: int = 0  # and with each sequence alone


class Scheduler:
    def __init__(
        self,
        engine,
        max_seqs: int = 4,
        max_queue: int = 64,
        batched: bool | None = None,
        cache_prompt: bool = True,
        cache_ram: int | None = PROMPT_CACHE_RAM_MIB << 20,
    ):
        """batched: None chooses per turn by measured speed (Mode); True always one pass where it can be
        captured, False each decoding sequence on its own (the load test's baseline). cache_prompt: reuse
        shared prefixes, with cache_ram bytes of host RAM for prefixes no cache holds (None: no limit)."""
        if max_seqs < 1 or max_queue < 1:
            raise MoestreamError("--max-seqs and the queue must hold at least one request")
        self.engine, self.max_seqs, self.batched = engine, max_seqs, batched
        budgeted = engine.options.serving.n_seqs
        if engine.options.placement.vram_budget is not None and budgeted < max_seqs:
            warnings.warn(
                f"--vram-budget counts {budgeted} sequence(s) but the server holds up to {max_seqs}: load the "
                f"engine with n_seqs={max_seqs}, or the extra KV caches may not fit",
                stacklevel=2,
            )
        self.queue: queue.Queue[Request] = queue.Queue(max_queue)
        self.running: list[_Sequence] = []
        self.stats = Stats()
        self.mode = Mode()
        self._caches: list = []  # free caches, reused
        self.prompts = PromptCache(engine.options.model.ubatch, cache_ram) if cache_prompt else None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moestream-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        if self._stop.is_set():  # nothing would serve it, and the caches are gone
            raise QueueFull("the server is shutting down")
        try:
            self.queue.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self.queue.maxsize} requests already wait; retry later") from None
        self._wake.set()

    def stop(self) -> None:
        """Drain: stop taking turns, end every sequence, wait for the thread (the engine is then idle), and free
        the pooled caches with their captured steps (another server on the same engine makes its own)."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._caches.clear()
        if self.prompts is not None:
            self.prompts.clear()

    @property
    def link_bytes(self) -> int:
        return self.engine.experts.counters.bytes_moved if self.engine.model is not None else 0

    @property
    def cache_experts(self) -> int:
        """Experts of each streamed layer the GPU expert cache holds now (0: none)."""
        pf = self.engine.experts.prefetcher if self.engine.model is not None else None
        return pf.cache.n if pf is not None and pf.cache is not None else 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if not self.running:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._turn()
            except Exception as e:  # a bug or an unexpected failure: end the running sequences, keep serving
                for seq in list(self.running):
                    self._fail(seq, e)
        for seq in list(self.running):
            self._send(seq.req, Event("error", text="the server is shutting down"))
            self._release(seq)
        while True:  # and those still waiting
            try:
                req = self.queue.get_nowait()
            except queue.Empty:
                break
            self._send(req, Event("error", text="the server is shutting down"))

    @staticmethod
    def _send(req: Request, event: Event) -> None:
        """Hand an event to the request's listener; one that is gone (its event loop closed) ends the request."""
        try:
            req.emit(event)
        except Exception:
            req.cancelled.set()

    def _admit(self) -> None:
        while len(self.running) < self.max_seqs:
            try:
                req = self.queue.get_nowait()
            except queue.Empty:
                return
            if req.cancelled.is_set():
                continue
            self.stats.requests += 1
            try:
                tok = self.engine.tokenizer
                stream = TextStream(tok) if tok is not None else None
                sampler = Sampler(req.params, req.prompt_tokens, req.constraint)
                cache, cached = self._cache_for(req)  # last: a failure before leaves the pool as it was
                seq = _Sequence(req, cache, sampler, stream, list(req.prompt_tokens[cached:]), cached=cached)
            except Exception as e:  # out of memory for another cache, say: this request fails, no other
                self.stats.failed += 1
                self._send(req, _error(e))
                continue
            self.running.append(seq)

    def _cache_for(self, req: Request) -> tuple[object, int]:
        """A cache for the request and how many of its prompt tokens are in it already: a free one that holds
        its prompt and max_tokens, or a new one of about that size (Setup.new_cache). A new cache may take room
        the expert cache holds; a free one that fits is reused instead (what it held goes to host RAM)."""
        need = min(self.engine.n_ctx, len(req.prompt_tokens) + req.params.limit)
        fits = [c for c in self._caches if c.kv.n_ctx >= need]
        if not fits and len(self._caches) + len(self.running) >= self.max_seqs:  # free ones all too small
            self._drop(min(self._caches, key=lambda c: c.kv.n_ctx))
        grow = None
        if len(self._caches) + len(self.running) < self.max_seqs and not (fits and self.engine.new_cache_shrinks(need)):
            grow = functools.partial(self.engine.new_cache, need)
        if self.prompts is None:
            cache = fits[-1] if fits else grow()
            cache.reset()
            n = 0
        else:
            running = [seq.cache for seq in self.running]
            cache, n = self.prompts.take(req.prompt_tokens, fits, running, grow, reuse=req.cache_prompt)
        if cache in self._caches:
            self._caches.remove(cache)
        return cache, n

    def _drop(self, cache) -> None:
        """Let a free cache go (what it held to host RAM first), for a larger one in its place."""
        if self.prompts is not None:
            self.prompts.release(cache)
        self._caches.remove(cache)

    def _release(self, seq: _Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._caches.append(seq.cache)

    def _turn(self) -> None:
        """Every running sequence moves one step: a prompt chunk, or one token (all decoding ones in one pass)."""
        stepping, prefilled = [], False
        for seq in list(self.running):
            if seq.req.cancelled.is_set():
                self._release(seq)
                continue
            try:
                if seq.pending:
                    prefilled = True  # its chunk's GPU work may still be queued when decoding starts
                    self._prefill(seq)
                elif self._take_token(seq):
                    stepping.append(seq)
            except Exception as e:  # this request fails; the others and the server go on
                self._fail(seq, e)
        if not stepping:
            return
        start = time.perf_counter()
        # one pass for all of them, replayed from a graph on a GPU; where a batch cannot be captured but one
        # token can, each sequence replays its own graph instead (faster than an eager pass there)
        n = len(stepping)
        step = self.engine.step
        forced = step.replays(1) and not step.replays(n)
        chosen = n > 1 and not forced and self.batched is None
        alone = forced or (self.mode.alone(n) if chosen else self.batched is False)
        groups = [[seq] for seq in stepping] if alone else [stepping]
        broke, captures = False, step.capturing.count
        for group in groups:
            try:
                logits = self.engine.forward_each([seq.token for seq in group], [seq.cache for seq in group])
            except Exception as e:
                broke = True  # the pass itself, not one request's sampling
                for seq in group:
                    self._fail(seq, e)
                continue
            for seq, row in zip(group, logits, strict=True):
                try:
                    seq.token = seq.sampler(row)
                except Exception as e:
                    self._fail(seq, e)
            self.stats.decode_tokens += len(group)
        if (counted := self.engine.experts.counters.stats()) is not None:  # after sampling's sync: a small read
            self.stats.picks, self.stats.guessed = counted.picks, counted.picks - counted.misses
            self.stats.held = counted.cached
        took = time.perf_counter() - start
        self.stats.decode_s += took
        if n > 1:
            self.stats.alone_turns += alone
            self.stats.batched_turns += not alone
        # a measure of this way's speed only if no pass failed (one dying early looks fast), nothing was
        # captured (a capture costs many turns) and no prompt chunk ran first
        if chosen and broke:
            self.mode.failed(alone, n)
        elif chosen and step.capturing.count == captures and not prefilled:
            self.mode.record(alone, n, took)

    def _fail(self, seq: _Sequence, e: Exception) -> None:
        self.stats.failed += 1
        self._send(seq.req, _error(e))
        self._release(seq)

    def _prefill(self, seq: _Sequence) -> None:
        """Run the next chunk of the prompt (whole micro-batches from where its cache ends, so the rows are those
        of a prefill in one call); after the last, sample the first token."""
        start = time.perf_counter()
        decoding = any(not other.pending for other in self.running if other is not seq)
        n = self.engine.options.model.ubatch * (PREFILL_UBATCHES_SHARED if decoding else PREFILL_UBATCHES)
        if self.prompts is not None:
            n = self.prompts.chunk(seq.cache, n)
        chunk, seq.pending = seq.pending[:n], seq.pending[n:]
        logits = self.engine.forward(chunk, seq.cache)
        if self.prompts is not None:
            self.prompts.prefilled(seq.cache)
        self.stats.prompt_tokens += len(chunk)
        self.stats.prefill_s += time.perf_counter() - start
        if not seq.pending:
            seq.token = seq.sampler(logits[-1])
            if seq.req.params.max_tokens == 0:
                self._finish(seq, "length")

    def _take_token(self, seq: _Sequence) -> bool:
        """Emit the sampled token; True if the sequence goes on (it needs a forward pass for the next one)."""
        p, tok = seq.req.params, self.engine.tokenizer
        if p.stop_at_eos and tok is not None and seq.token in tok.eos_ids:
            self._finish(seq, "stop")
            return False
        seq.tokens.append(seq.token)
        if seq.sampler.last is not None:
            seq.logprobs.append((len(seq.text), seq.sampler.last))
        if seq.stream is not None:
            seq.text += seq.stream.push(seq.token)
        if self._emit_text(seq):
            return False
        if len(seq.tokens) >= p.max_tokens or seq.cache.n_past >= seq.cache.kv.n_ctx:
            self._finish(seq, "length")
            return False
        return True

    def _emit_text(self, seq: _Sequence) -> bool:
        """Send new text, holding back what could be the start of a stop string; True if a stop string ended it."""
        stops = seq.req.stop
        if stops:
            hits = [i for s in stops if (i := seq.text.find(s, max(seq.sent - len(s) + 1, 0))) >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                self._finish(seq, "stop", flush=False)
                return True
        hold = max((len(s) - 1 for s in stops), default=0)
        end = max(len(seq.text) - hold, seq.sent)
        if end > seq.sent:
            self._send(seq.req, Event("text", text=seq.text[seq.sent : end], logprobs=self._logprobs(seq, end)))
            seq.sent = end
        return False

    @staticmethod
    def _logprobs(seq: _Sequence, end: int | None = None) -> list[TokenLogprob]:
        """Taken: the log-probabilities of the tokens whose text starts before end (all: None). A token's text held
        back (a stop string's possible start) keeps its logprob back too: a stop string cuts both."""
        out = [lp for start, lp in seq.logprobs if end is None or start < end]
        seq.logprobs = seq.logprobs[len(out) :]
        return out

    def _finish(self, seq: _Sequence, reason: str, flush: bool = True) -> None:
        if seq.stream is not None and flush:  # bytes of an unfinished character
            seq.text += seq.stream.flush()
        if seq.sent < len(seq.text):
            self._send(seq.req, Event("text", text=seq.text[seq.sent :], logprobs=self._logprobs(seq, len(seq.text))))
        if not flush:  # a stop string cut the text: the tokens past the cut go unreported
            seq.logprobs = []
        self._send(
            seq.req,
            Event(
                "done",
                finish_reason=reason,
                prompt_tokens=len(seq.req.prompt_tokens),
                completion_tokens=len(seq.tokens),
                cached_tokens=seq.cached,
                logprobs=self._logprobs(seq),
            ),
        )
        self._release(seq)
