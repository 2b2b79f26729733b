"""The decode step: one token for a sequence (or one for each of several) as a static pass, replayed from a
CUDA graph where it can be captured.

A decode step launches dozens of small kernels per layer; launched one by one from Python that costs more
than the GPU work. A static step (positions only on the device, a fixed number of KV rows read under a mask,
streamed experts picked on the device) queues the same work every token, so it is captured once per
sequence cache and key-count bucket and then replayed: one launch per token (runtime/graphs.py keeps them).
The first step of a bucket runs eagerly (the warm-up a capture needs, which compiles the Triton kernels one by
one; with tuning's compile_ahead the first pass is recorded once before, in a capture thrown away, so they
compile side by side), later ones replay; both run the same kernels, so they give the same bits. A server's
running batch (a token for each of several sequences) is captured the same way, once per set of caches and
buckets. Gathered layers' experts are guessed from the input of an earlier layer (offload/prefetch.py; for every
row of a batch) and fetched beside it.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch

from moestream.kernels import compiles, launch, tuning
from moestream.models.layers import Batch
from moestream.offload.experts import ExpertPass, LayerExperts
from moestream.profiling.timeline import NULL, Timeline
from moestream.runtime import graphs
from moestream.runtime.graphs import StepGraphs
from moestream.runtime.kv_cache import SequenceCache

MIN_KEYS = 256


def key_bucket(n_past: int, n_ctx: int) -> int:
    """KV rows a step at position n_past reads: a power of two from MIN_KEYS up, at most n_ctx.

    Few buckets (few captures) while short sequences do not read the whole context every token."""
    n = MIN_KEYS
    while n <= n_past:
        n *= 2
    return min(n, n_ctx)


@dataclass
class Capturing:
    """Whether steps are still captured, kept across placements: once CUDA refused a capture, such steps run
    eagerly (the same kernels, the same bits). count: steps captured (or tried) so far, a turn that captured
    being no measure of speed; unrolled: the row unrollings (kernels/tuning.py) their kernels were compiled with."""

    one: bool = True  # one-token steps
    batch: bool = True  # batches (a one-token step failing clears both)
    count: int = 0
    unrolled: set[int] = field(default_factory=set)


class DecodeStep:
    """Static one-token passes over model with the experts of one placement; `timeline` records them (and then
    runs them eagerly)."""

    def __init__(self, model, experts: LayerExperts, dtype: torch.dtype, capturing: Capturing | None = None):
        self.model, self.experts, self.dtype = model, experts, dtype
        self.device = experts.dev.device
        self.capturing = capturing or Capturing()
        self.timeline: Timeline = NULL
        self.graphs: weakref.WeakKeyDictionary[SequenceCache, StepGraphs] = weakref.WeakKeyDictionary()
        self.batch_graphs: StepGraphs | None = None  # batches', by caches and key buckets
        self.compiled_ahead: set[int] = set()  # row counts whose first pass compiled its kernels side by side

    def replays(self, n_seqs: int = 1) -> bool:
        """Whether a step of one token for each of n_seqs sequences replays a CUDA graph here (else it runs
        eagerly, and a server does better stepping its sequences one by one, each replaying its own)."""
        ok = self.capturing.one if n_seqs == 1 else self.capturing.batch
        rows = min(n_seqs, tuning.current().max_tokens)  # each()'s passes
        return ok and self.device.type == "cuda" and self.experts.capturable(rows, self.model.spec.n_expert_used)

    def one(self, token: int, cache: SequenceCache) -> torch.Tensor:
        """Logits [1, V] of token after cache's sequence, appended to it."""
        n_keys = key_bucket(cache.n_past, cache.kv.n_ctx)
        captured = self.graphs.setdefault(cache, StepGraphs()) if self._captures(1) else None
        return self._pass([token], [cache], n_keys, captured, n_keys)

    def each(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """Logits [B, V] of one token for each of distinct sequences: the projections and experts run once for
        all rows, attention and recurrent state per sequence. Replayed from a graph captured once per set of
        caches and key buckets (a server's caches come from a reused pool, so a few captures serve many)."""
        # one graph whatever order rows come in, and the same order each run (by address, a row's place in the
        # batch, and so its bits on the CPU, changed from run to run)
        order = sorted(range(len(caches)), key=lambda i: caches[i].serial)
        tokens, caches = [tokens[i] for i in order], [caches[i] for i in order]
        most = tuning.current().max_tokens if self.device.type == "cuda" else len(tokens)
        # on a GPU, passes of at most the tuning's max_tokens rows: more would dequantize every weight and multiply
        # on other kernels, so a row's bits would depend on the batch (and the weights be dequantized each step)
        parts = [self._rows(tokens[i : i + most], caches[i : i + most]) for i in range(0, len(tokens), most)]
        return torch.cat(parts)[torch.tensor(order).argsort()]

    def _rows(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """A pass of rows sorted by cache: one replayed graph per set of caches and key buckets."""
        if len(tokens) == 1:
            return self.one(tokens[0], caches[0])
        n_keys = tuple(key_bucket(c.n_past, c.kv.n_ctx) for c in caches)
        captured = None
        if self._captures(len(caches)):
            captured = self.batch_graphs = self.batch_graphs or StepGraphs(limit=graphs.BATCH_GRAPHS)
        key = (tuple(id(c) for c in caches), n_keys)  # a freed cache's steps are dropped: no id names two
        return self._pass(tokens, caches, n_keys, captured, key, watch=caches)

    def _captures(self, n_seqs: int) -> bool:
        return self.timeline is NULL and self.replays(n_seqs)  # recording runs each pass eagerly

    def _pass(self, tokens, caches, n_keys, captured: StepGraphs | None, key, watch=()) -> torch.Tensor:
        """A static pass of one token for each cache: replayed from captured[key] if there, else run eagerly
        (the warm-up a capture needs) and then captured when captured is given. Whole-layer uploads are planned
        (--stream-min-batch 1), experts read the same way whatever the slots hold, the caches retired if it
        fails half-way."""
        experts, n_layer = self.experts, self.model.spec.n_layer
        x = self.model.embed(torch.tensor(tokens))
        p = experts.begin([il for il in range(n_layer) if experts.streams(il, len(caches))], True, self.timeline)
        try:
            positions = [c.n_past for c in caches]
            if captured is not None and key in captured:
                logits = captured.replay(x, positions, key, experts.counters)
            else:
                on_device, body = torch.tensor(positions, device=self.device), partial(self._layers, p, n_keys, caches)
                if captured is not None and len(caches) not in self.compiled_ahead:
                    self.compiled_ahead.add(len(caches))
                    self._compile_ahead(body, x, on_device)
                logits = body(x, on_device)
                if captured is not None:
                    self._capture(captured, body, x, on_device, key, watch)
        except BaseException:
            for c in caches:
                c.broken = True  # a KV row or recurrent state may be half-written
            raise
        finally:
            p.end()
        for c in caches:
            c.n_past += 1
        return logits

    def _layers(self, p: ExpertPass, n_keys, caches, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every layer, then the head: the body of a static pass (and of a captured step, x and positions its
        inputs). Gathered layers' experts are guessed at the start of an earlier layer and fetched beside it."""
        model = self.model
        if isinstance(n_keys, int):  # one sequence
            batch, cache = model.static_batch(positions, n_keys, self.dtype), caches[0]
        else:
            rows = tuple(model.static_batch(positions[i : i + 1], n, self.dtype) for i, n in enumerate(n_keys))
            batch, cache = Batch(-1, *model.rope(positions, self.dtype), positions, rows=rows), caches
        guesses, width = p.guess_plan(x.shape[0]), self.experts.guess_width
        for later in guesses.get(-1, ()):
            p.prefetch(later, model.guess_experts(later, x, width))
        for il in range(model.spec.n_layer):
            p.start_layer(il, 0)
            for later in guesses.get(il, ()):
                p.prefetch(later, model.guess_experts(later, x, width))
            x = model.layer(il, x, batch, cache, p)
        p.layers_done()
        with self.timeline.span("compute", "head"):
            return model.head(x).float()

    def _capture(self, captured: StepGraphs, step, x: torch.Tensor, positions: torch.Tensor, key, watch) -> None:
        """Capture a step; if CUDA refuses, say so once and run such steps eagerly (same kernels, same bits). A
        batch that fails (out of memory, say) leaves one-token steps captured."""
        self.capturing.count += 1
        self.capturing.unrolled.add(tuning.current().unrolled)
        try:
            captured.capture(step, x, positions, key, self.experts.counters, watch)
        except RuntimeError as e:
            batch = captured is self.batch_graphs
            self.capturing.batch = False
            if batch:
                self._forget_batches()
            else:
                self.capturing.one = False
                self.close()
            self.experts.forget()  # events recorded in the capture never ran
            what = "batched decode steps (one sequence's still replay)" if batch else "decode steps"
            warnings.warn(f"{what} could not be captured in a CUDA graph ({e}); running eagerly", stacklevel=4)

    def _compile_ahead(self, step, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Compile a first captured step's Triton kernels side by side (kernels/compiles.py) before it runs
        eagerly: recorded in a capture that is thrown away (nothing runs; the streamer's and prefetcher's events
        recorded there never will). If CUDA refuses, the eager pass compiles them at first launch. The capture is
        relaxed: in CUDA's default (global) mode an unsafe call from any thread (a finalizer's, a compiling
        thread's) would void it part-way."""
        if launch.triton is None or not tuning.current().compile_ahead:
            return
        counters, stream = self.experts.counters, torch.cuda.current_stream()
        before = counters.read_bytes
        try:
            with compiles.side_by_side(launch.triton), torch.cuda.device(self.device):
                with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="relaxed"):
                    step(x, positions)
        except Exception:  # only a head start: the eager pass that follows meets any real error again
            pass
        finally:
            torch.cuda.set_stream(stream)
            counters.read_bytes = before
            self.experts.forget()

    def close(self) -> None:
        """Drop every captured step (their memory, and what they read, with them)."""
        self.graphs.clear()
        self._forget_batches()

    def _forget_batches(self) -> None:
        if self.batch_graphs is not None:
            self.batch_graphs.close()
        self.batch_graphs = None
