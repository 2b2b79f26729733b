"""`moestream bench`: prefill and decode throughput per placement and schedule, against the two floors.

Every row of one run shares the loaded weights; only the offload side is rebuilt between rows.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.options import Schedule
from moestream.profiling.stats import summarize
from moestream.profiling.timeline import Timeline
from moestream.tools.probe import h2d_rate, timed
from moestream.tools.sweep import Sweep
from moestream.tools.tokens import random_prompt, text_tokens


@dataclass
class BenchRow:
    model: str
    size_gib: float
    n_cpu_moe: int
    ubatch: int
    stream: str
    slots: int
    streamed_layers: str  # first | spread
    test: str  # ppN (prefill N tokens) or tgN (decode N tokens), "@ dD" after D tokens of context
    tps: float
    tps_std: float
    seconds: float
    bytes_uploaded: int  # per run
    experts_used: float  # mean fraction of experts the router used per streamed layer and micro-batch
    link_gbs: float  # bytes uploaded / run time
    copy_gbs: float | None  # bytes uploaded / time the copies took (the link while copying); None: no uploads
    gpu_peak_gib: float  # the most GPU memory allocated during the timed runs (0 on the CPU)
    transfer_floor_s: float = 0.0  # bytes uploaded / pinned link rate
    compute_floor_s: float = 0.0  # the same test with every expert resident
    same_tokens: bool = True  # greedy next token equals the first row's
    same_bits: bool | None = None  # last logits identical to the first row with the same ubatch
    samples_s: list[float] = field(default_factory=list)  # each timed run
    small_batch: str = ""  # what micro-batches under --stream-min-batch did (auto resolved)
    links_gbs: list[float] = field(default_factory=list)  # --devices: each device's link, bytes into its ring / run
    prefetch: int = 0  # experts guessed a gathered layer ahead in decode (0: none)
    prefetch_ahead: int = 0  # streamed layers before its own a layer's guess was made (0: no guesses)
    prefetch_hit: float | None = None  # the fraction of those layers' picks that were guessed (None: no prefetch)
    expert_cache: int = 0  # experts of each streamed layer the cache held (0: none)
    cache_hit: float | None = None  # the fraction of prefetched layers' picks it held (None: no cache)
    n_depth: int = 0  # tokens of context before the test (llama-bench's n_depth), their prefill not timed
    type_k: str = ""  # the KV cache's types (-ctk/-ctv, auto resolved)
    type_v: str = ""
    tokens: str = "random"  # what the tests ran: random ids, or a --text file's name
    cache_policy: str = "lru"  # which experts the cache held (--cache-policy)
    cpu_layers: int = 0  # streamed layers whose small batches computed on the CPU (all of them under the cpu way)

    @property
    def kind(self) -> str:
        """pp or tg."""
        return self.test[:2]

    @property
    def n_tokens(self) -> int:
        """The test's own tokens: N of ppN or tgN."""
        return int(self.test[2:].split()[0])


def named_test(kind: str, n: int, depth: int) -> str:
    """A row's test as llama-bench names it: pp512, tg128, pp512 @ d8192."""
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")


def bench_tokens(text: list[int] | None, n: int, n_vocab: int, depth: int = 0) -> tuple[list[int], list[int]]:
    """A test's `depth` tokens of context and its n tokens: the text's (repeated to length; the test's continue
    its context), else random ids. Decode feeds them one at a time, whatever the model would have sampled, so
    every row and schedule runs the same sequence."""
    if text is None:
        return random_prompt(depth, n_vocab, seed=1), random_prompt(n, n_vocab)
    seq = (text * -(-(depth + n) // len(text)))[: depth + n]
    return seq[:depth], seq[depth:]


@dataclass(frozen=True)
class _Measured:
    """What timing one test gave."""

    times: list[float]  # seconds, each run
    logits: torch.Tensor | None  # the last prefill's (None for decode tests)
    moved: int  # expert bytes over the link a run
    used: float  # mean fraction of experts the router used per streamed layer and micro-batch
    peak_gib: float  # GPU memory high-water mark (0 on the CPU)
    copy_gbs: float | None  # the link while copying (None: no uploads)
    links: list[float]  # bytes a run into each device's ring (--devices)
    hit: float | None  # the fraction of prefetched layers' picks that were guessed (None: no prefetch)
    cached: float | None  # the fraction of them the expert cache held (None: no cache)


class _Tally:
    """What the timed runs of a test moved and picked, summed over the runs only (not the untimed prefill of
    the depth before each, nor the warm-up)."""

    def __init__(self, experts):
        self.counters, self.streamer = experts.counters, experts.streamer
        self.moved, self.picks, self.usage = 0, None, []
        self.links = [0] * len(getattr(self.streamer, "link_bytes", []))  # one entry a device with --devices

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        c = self.counters
        c.usage = []
        moved, picks, links = c.bytes_moved, c.stats(), list(getattr(self.streamer, "link_bytes", []))
        yield
        self.moved += c.bytes_moved - moved
        if picks is not None:
            delta = [b - a for a, b in zip(picks, c.stats(), strict=True)]
            self.picks = delta if self.picks is None else [a + b for a, b in zip(self.picks, delta, strict=True)]
        now = getattr(self.streamer, "link_bytes", [])
        self.links = [t + b - a for t, a, b in zip(self.links, links, now, strict=True)]
        self.usage += c.usage
        c.usage = None


def _measure(engine, kind: str, tokens: list[int], repeats: int, context: list[int]) -> _Measured:
    """Time `repeats` runs of a pp or tg test over tokens after a warm-up, each after the context (llama-bench's
    n_depth tokens), whose prefill is not timed."""
    experts = engine.experts
    streamer = experts.streamer
    last = {}
    cache = engine.new_cache()  # one for every run, as a server slot would be: its captured steps are reused

    def at_depth():
        cache.reset()
        if context:
            engine.forward(context, cache)

    def prefill():
        last["logits"] = engine.forward(tokens, cache)

    def decode():
        engine.forward(tokens[:1], cache)
        for t in tokens[1:]:
            engine.forward([t], cache)

    fn = prefill if kind == "pp" else decode
    copy_gbs = None
    at_depth()
    if streamer is None:
        fn()  # warm-up (also fills allocator caches)
    else:  # the warm-up pass also times the uploads on the copy stream (events there only: compute untouched)
        streamer.timeline = copies = Timeline(engine.device)
        try:
            fn()
        finally:
            streamer.timeline = engine.setup.timeline
        copy_gbs = summarize(copies.resolve()).copy_gbps
    tally = _Tally(experts)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    times = []
    for _ in range(repeats):
        at_depth()
        with tally.run():
            times += timed(fn, engine.device, repeats=1, warmup=0)
    peak = torch.cuda.max_memory_allocated(engine.device) / 2**30 if cuda else 0.0
    hit = cached = None
    if tally.picks is not None:
        picks, misses, _, _, held = tally.picks
        hit = 1 - misses / picks if picks else None
        if experts.cached_width and picks:
            cached = held / picks
    used = float(torch.stack(tally.usage).mean()) if tally.usage else 0.0
    return _Measured(
        times=times,
        logits=last.get("logits"),
        moved=tally.moved // repeats,
        used=used,
        peak_gib=peak,
        copy_gbs=copy_gbs,
        links=[b / repeats for b in tally.links],
        hit=hit,
        cached=cached,
    )


def model_name(engine) -> str:
    """The model's name in the bench rows: the file's general.name, else its file name."""
    return engine.source.metadata.get("general.name", engine.source.path.name)


def run_bench(engine, sweep: Sweep, progress=None, say=None) -> tuple[list[BenchRow], float]:
    """Every combination of the lists; returns the rows and the pinned link rate (bytes/s) measured first.
    progress(row) is called as each row finishes, say(text) as each test starts (a row can take minutes)."""
    f = engine.source
    size = f.path.stat().st_size / 2**30
    name = model_name(engine)
    link = h2d_rate(engine.device, 1 << 28 if engine.device.type == "cuda" else 1 << 26)  # fits beside the model
    rows: list[BenchRow] = []
    first_logits: dict[tuple[str, int], torch.Tensor] = {}
    first_token: dict[str, int] = {}
    compute_floor: dict[tuple[str, int], float] = {}
    w = sweep
    tests = [(kind, n, d) for d in w.depths for kind, ns in (("pp", w.prompts), ("tg", w.gens)) for n in ns if n > 0]
    text = text_tokens(engine, w.text) if w.text else None
    combos = w.placements()
    for i, placed in enumerate(combos):
        engine.setup.reconfigure(**placed, progress=False)
        ub, stream, k, pick = (placed[key] for key in ("ubatch", "stream", "slots", "streamed_layers"))
        for kind, n, depth in tests:
            test = named_test(kind, n, depth)
            if say:
                shown = " ".join(f"{key} {value}" for key, value in placed.items() if value is not None)
                say(f"placement {i + 1}/{len(combos)}, {test} x {w.repeats} after a warm-up: {shown}")
            context, tokens = bench_tokens(text, n, engine.spec.n_vocab, depth)
            m = _measure(engine, kind, tokens, w.repeats, context)
            secs = statistics.mean(m.times)
            tps = [n / t for t in m.times]
            experts = engine.experts  # not kept past this row: its staging slots hold device memory
            row = BenchRow(
                model=name,
                size_gib=round(size, 2),
                n_cpu_moe=engine.offload.placement.n_cpu_moe,
                ubatch=ub,
                stream=stream,
                slots=len(experts.streamer.slots) if experts.streamer else k,  # what ran
                streamed_layers=pick,
                test=test,
                tps=statistics.mean(tps),
                tps_std=statistics.pstdev(tps),
                seconds=secs,
                bytes_uploaded=m.moved,
                experts_used=m.used,
                link_gbs=m.moved / secs / 1e9,
                copy_gbs=m.copy_gbs,
                gpu_peak_gib=m.peak_gib,
                transfer_floor_s=m.moved / link,
                samples_s=list(m.times),
                small_batch=experts.plan.way,
                links_gbs=[b / secs / 1e9 for b in m.links],
                prefetch=experts.guess_width,
                prefetch_ahead=experts.guess_ahead,
                prefetch_hit=m.hit,
                expert_cache=experts.cached_width,
                cache_hit=m.cached,
                n_depth=depth,
                tokens=Path(w.text).name if w.text else "random",
                cache_policy=engine.options.decode.cache_policy,
                cpu_layers=len(experts.on_cpu),
            )
            row.type_k, row.type_v = engine.options.model.kv_types
            del experts
            if m.logits is not None:
                tok = int(torch.argmax(m.logits[-1]))
                row.same_tokens = first_token.setdefault(test, tok) == tok
                ref = first_logits.setdefault((test, ub), m.logits)
                row.same_bits = bool(torch.equal(ref, m.logits))
            rows.append(row)
            if progress:
                progress(row)
    if w.floors:
        for ub in w.ubatches:
            engine.setup.reconfigure(ubatch=ub, n_cpu_moe=0, stream=Schedule.OVERLAP, vram_budget=None, progress=False)
            for kind, n, depth in tests:
                context, tokens = bench_tokens(text, n, engine.spec.n_vocab, depth)
                m = _measure(engine, kind, tokens, w.repeats, context)
                compute_floor[(named_test(kind, n, depth), ub)] = min(m.times)  # a floor: the best run, not the mean
        for row in rows:
            row.compute_floor_s = compute_floor[(row.test, row.ubatch)]
    return rows, link
