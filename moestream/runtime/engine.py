"""The engine: micro-batched prefill, decode, sampling, over a model whose experts live wherever placement put them."""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.tokenizer import TextStream
from moestream.kernels import tuning
from moestream.models.layers import Batch
from moestream.offload.device import cap_vram
from moestream.offload.experts import ExpertPass, LayerExperts, OnRoute
from moestream.offload.options import EngineOptions
from moestream.offload.schedule import Schedule
from moestream.profiling.timeline import NULL, Timeline
from moestream.runtime import decode, small_batch
from moestream.runtime.decode import StepGraphs, key_bucket
from moestream.runtime.kv_cache import KVCache, SequenceCache
from moestream.runtime.sampling import Sampler, SamplingParams


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"  # length | eos | context | interrupted
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


class Engine:
    def __init__(self, model, tokenizer, options: EngineOptions, source=None, offload=None, make_offload=None):
        self.model = model
        self.offload = offload  # placement, streamer and device resources, closed with the engine
        self._make_offload = make_offload
        self.timeline: Timeline = NULL
        self.spec = model.spec
        self.tokenizer = tokenizer
        self.options = options
        self.source = source  # the open GGUF file the weights map, closed with the engine
        self.n_ctx = options.context(self.spec.n_ctx_train)
        if options.n_ctx > self.n_ctx:
            warnings.warn(
                f"--ctx {options.n_ctx} is more than the {self.n_ctx} positions the model was trained for; "
                f"using {self.n_ctx}",
                stacklevel=2,
            )
        self._graphs: weakref.WeakKeyDictionary[SequenceCache, StepGraphs] = weakref.WeakKeyDictionary()
        self._batch_graphs: StepGraphs | None = None  # forward_each's, by caches and key buckets
        self._graphs_ok = True  # False once a capture failed: later steps run eagerly
        self._batches_ok = True  # the same for batches (forward_each); a one-token step failing clears both
        self.captures = 0  # steps captured (or tried) so far: a turn that captured is no measure of speed
        self._cache: SequenceCache | None = None  # generate()'s, reused so its captured steps are too
        self.measured: small_batch.Measured | None = None  # what --small-batch auto timed at the last placement

    def record(self, timeline: Timeline) -> None:
        """Send copy and compute spans of the following passes to timeline (NULL turns recording off)."""
        self.timeline = timeline
        self.experts.record(timeline)

    @property
    def experts(self) -> LayerExperts:
        """Where each layer's experts come from, for the current placement."""
        return self.offload.experts

    def reconfigure(self, **changes) -> None:
        """Change placement or schedule (n_cpu_moe, stream, slots, ubatch...) without reloading dense weights.

        On a bad change the engine keeps working with its previous options."""
        if "deltanet" in changes:  # the model chose its delta rule when it was built
            raise MoestreamError("the delta-net rule is chosen at load: load the model again with deltanet=...")
        options = dataclasses.replace(self.options, **changes)
        failed = None
        try:
            self._rebuild(options)
        except BaseException as e:
            failed = e.with_traceback(None)  # the traceback would keep the half-built placement's memory alive
        if failed is not None:
            self._rebuild(self.options)
        else:
            self.options = options
        self.record(self.timeline)
        if failed is not None:
            raise failed
        self.settle_small_batch()

    def _rebuild(self, options: EngineOptions) -> None:
        """A new placement for options, the old one's memory and page locks released first."""
        self._forget_graphs()  # captured steps read the old expert buffers; free their memory before the new ones
        if self.offload is not None:
            self.offload.close()  # first: the new placement may page-lock the same ranges
        self.offload = None  # and let its device memory go before the new one is made
        self.offload = self._make_offload(options)

    def settle_small_batch(self) -> None:
        """--small-batch auto on a GPU with streamed layers: time each way a few decode steps and keep the
        fastest (runtime/small_batch.py) in a fresh placement (clean byte counts and expert cache, and the
        buffers that way needs). `measured` says what was timed (None: nothing)."""
        self.measured = None
        if self._make_offload is None or not small_batch.needed(self):
            return
        measured = small_batch.measure(self)
        start = time.perf_counter()
        self._rebuild(dataclasses.replace(self.options, small_batch=measured.chosen))  # self.options stay auto
        self.record(self.timeline)
        self.measured = dataclasses.replace(measured, rebuilding=time.perf_counter() - start)
        if self.options.progress:
            print(self.measured.describe(), file=sys.stderr)

    @property
    def device(self) -> torch.device:
        return self.options.torch_device

    @property
    def dtype(self) -> torch.dtype:
        return self.options.torch_dtype

    def _require_open(self) -> None:
        if self.model is None:
            raise MoestreamError("this engine is closed; load the model again")

    def new_cache(self) -> SequenceCache:
        self._require_open()
        s = self.spec
        kv = KVCache(self.model.attention_layers, self.n_ctx, s.n_head_kv, s.head_dim, self.dtype, self.device)
        return SequenceCache(kv, self.model.new_recurrent_state(self.device))

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], cache: SequenceCache, all_logits: bool = False, on_route: OnRoute | None = None
    ) -> torch.Tensor:
        """Run tokens through the model in micro-batches of options.ubatch, appending to cache.

        Token-major runs each micro-batch through every layer; layer-major runs every micro-batch through
        layer L before layer L+1, so each streamed layer crosses the link once per prompt. Both compute
        exactly what chunked prefill computes. Returns logits [T, V] if all_logits else [1, V]. on_route sees
        each layer's MoE input and routing (a single token then runs as a prefill, not a decode step).
        """
        self._check(tokens, cache)
        if len(tokens) == 1 and on_route is None:
            return self._step(tokens[0], cache)
        ub, n_layer, experts = self.options.ubatch, self.spec.n_layer, self.experts
        chunks = [tokens[i : i + ub] for i in range(0, len(tokens), ub)]
        if self.options.stream is Schedule.LAYER_MAJOR and len(chunks) > 1:
            order = [(il, j) for il in range(n_layer) for j in range(len(chunks))]
            visits = [il for il in range(n_layer) if any(experts.streams(il, len(c)) for c in chunks)]
        else:
            order = [(il, j) for j in range(len(chunks)) for il in range(n_layer)]
            visits = [il for c in chunks for il in range(n_layer) if experts.streams(il, len(c))]
        show = self.options.progress and len(chunks) > 1
        # Inputs first: their small host-to-device copies would otherwise wait behind the expert uploads on the
        # copy engine (measured on the H200: compute started only after the first three layers had arrived).
        make = self.model.make_batch
        batches = [make(cache.n_past + i * ub, len(c), self.device, self.dtype) for i, c in enumerate(chunks)]
        xs = [self.model.embed(torch.tensor(c)) for c in chunks]  # token ids stay on the host: rows are read there
        p = experts.begin(visits, timeline=self.timeline, on_route=on_route)
        started = False
        try:
            for il, j in tqdm(order, desc="prefill", unit="layer", disable=not show, leave=False):
                p.start_layer(il, j)
                started = True
                xs[j] = self.model.layer(il, xs[j], batches[j], cache, p)
        except BaseException:
            if started:  # some layers' KV / recurrent state already moved on: the cache is unusable
                cache.broken = True
            raise
        finally:
            p.end()
        cache.n_past += len(tokens)
        with self.timeline.span("compute", "head"):
            if all_logits:
                return torch.cat([self.model.head(x).float() for x in xs])
            return self.model.head(xs[-1][-1:]).float()

    def _check(self, tokens: list[int], cache: SequenceCache) -> None:
        """What every pass needs before it touches the cache: an open engine, tokens, room, known ids."""
        self._require_open()
        if not tokens:
            raise MoestreamError("no tokens to run: the prompt is empty")
        if cache.broken:
            raise MoestreamError("this sequence's cache was left half-updated by an interrupted pass; start a new one")
        if cache.n_past + len(tokens) > self.n_ctx:
            raise MoestreamError(
                f"the prompt needs {cache.n_past + len(tokens)} positions but the context is {self.n_ctx} "
                f"(--ctx, at most the {self.spec.n_ctx_train} the model was trained for); raise --ctx up to "
                "that or shorten the prompt"
            )
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.spec.n_vocab:
            raise MoestreamError(f"token ids must be in [0, {self.spec.n_vocab}); got {min(tokens)}..{max(tokens)}")

    def _step(self, token: int, cache: SequenceCache) -> torch.Tensor:
        """One token as a static pass: replayed from a CUDA graph where the step can be captured."""
        model = self.model
        n_keys = key_bucket(cache.n_past, self.n_ctx)
        graphs = None
        if self.timeline is NULL and self.replays():
            graphs = self._graphs.setdefault(cache, StepGraphs())

        def step(p: ExpertPass, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self._layers(x, model.static_batch(positions, n_keys, self.dtype), cache, p)

        return self._replayed([cache], model.embed(torch.tensor([token])), step, graphs, n_keys)

    @torch.inference_mode()
    def forward_each(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """One token for each of several sequences in one pass (a server's running batch): the projections
        and experts run once for all rows, attention and recurrent state per sequence. Returns logits [B, V].

        Replayed from a CUDA graph where `replays(B)`, captured once per set of caches and key buckets (a
        server's caches come from a reused pool, so a few captures serve many requests)."""
        if not tokens or len(tokens) != len(caches) or len({id(c) for c in caches}) != len(caches):
            raise MoestreamError("forward_each takes one token for each of distinct sequences")
        for token, cache in zip(tokens, caches, strict=True):
            self._check([token], cache)
        order = sorted(range(len(caches)), key=lambda i: id(caches[i]))  # one graph whatever order rows come in
        tokens, caches = [tokens[i] for i in order], [caches[i] for i in order]
        most = tuning.current().max_tokens if self.device.type == "cuda" else len(tokens)
        # on a GPU, passes of at most MAX_TOKENS rows: more would dequantize every weight and multiply on other
        # kernels, so a row's bits would depend on the batch (and the weights be dequantized each step)
        parts = [self._pass_each(tokens[i : i + most], caches[i : i + most]) for i in range(0, len(tokens), most)]
        return torch.cat(parts)[torch.tensor(order).argsort()]

    def _pass_each(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """forward_each's pass of rows sorted by cache: one replayed graph per set of caches and key buckets."""
        if len(tokens) == 1:
            return self.forward(tokens, caches[0])
        model = self.model
        n_keys = tuple(key_bucket(c.n_past, self.n_ctx) for c in caches)
        graphs = None
        if self.timeline is NULL and self.replays(len(caches)):
            graphs = self._batch_graphs = self._batch_graphs or StepGraphs(limit=decode.BATCH_GRAPHS)

        def step(p: ExpertPass, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            rows = tuple(model.static_batch(positions[i : i + 1], n, self.dtype) for i, n in enumerate(n_keys))
            return self._layers(x, Batch(-1, *model.rope(positions, self.dtype), positions, rows=rows), caches, p)

        key = (tuple(id(c) for c in caches), n_keys)  # a freed cache's steps are dropped: no id names two
        return self._replayed(caches, model.embed(torch.tensor(tokens)), step, graphs, key, watch=caches)

    def _replayed(self, caches: list[SequenceCache], x: torch.Tensor, step, graphs: StepGraphs | None, key, watch=()):
        """A static pass of step(pass, x, positions), one token for each cache: replayed from graphs[key] if
        captured, else run eagerly (the warm-up a capture needs) and then captured when graphs is given."""

        def run(p: ExpertPass) -> torch.Tensor:
            positions = [c.n_past for c in caches]
            if graphs is not None and key in graphs:
                return graphs.replay(x, positions, key, self.experts)
            on_device = torch.tensor(positions, device=self.device)
            logits = step(p, x, on_device)
            if graphs is not None:
                self._capture(graphs, partial(step, p), x, on_device, key, watch)
            return logits

        return self._static_pass(caches, len(caches), run)

    def _layers(self, x: torch.Tensor, batch: Batch, cache, p: ExpertPass) -> torch.Tensor:
        """Every layer, then the head: the body of a static pass (and of a captured step). Gathered layers'
        experts are guessed from the input of an earlier layer (offload/prefetch.py) and fetched beside it."""
        model = self.model
        plan, width = p.guess_plan(x.shape[0]), self.experts.guess_width

        def guess(at: int, x: torch.Tensor) -> None:
            if at in plan:
                p.prefetch(plan[at], model.guess_experts(plan[at], x, width))

        guess(-1, x)
        for il in range(self.spec.n_layer):
            p.start_layer(il, 0)
            guess(il, x)
            x = model.layer(il, x, batch, cache, p)
        p.layers_done()
        with self.timeline.span("compute", "head"):
            return model.head(x).float()

    def _static_pass(self, caches: list[SequenceCache], n_tokens: int, run: Callable[[ExpertPass], torch.Tensor]):
        """run() a static pass of n_tokens that appends one token to each cache: whole-layer uploads planned
        (--stream-min-batch 1), experts read the same way whatever the slots hold, the caches retired if it
        fails half-way."""
        experts = self.experts
        p = experts.begin([il for il in range(self.spec.n_layer) if experts.streams(il, n_tokens)], True, self.timeline)
        try:
            logits = run(p)
        except BaseException:
            for c in caches:
                c.broken = True  # a KV row or recurrent state may be half-written
            raise
        finally:
            p.end()
        for c in caches:
            c.n_past += 1
        return logits

    def replays(self, n_seqs: int = 1) -> bool:
        """Whether a step of one token for each of n_seqs sequences replays a CUDA graph here (else it runs
        eagerly, and a server does better stepping its sequences one by one, each replaying its own)."""
        ok = self._graphs_ok if n_seqs == 1 else self._batches_ok
        rows = min(n_seqs, tuning.current().max_tokens)  # forward_each's passes
        return ok and self.device.type == "cuda" and self.experts.capturable(rows, self.spec.n_expert_used)

    def _capture(self, graphs: StepGraphs, step, x: torch.Tensor, positions: torch.Tensor, key, watch) -> None:
        """Capture a step; if CUDA refuses, say so once and run such steps eagerly (same kernels, same bits). A
        batch that fails (out of memory, say) leaves one-token steps captured."""
        self.captures += 1
        try:
            graphs.capture(step, x, positions, key, self.experts, watch)
        except RuntimeError as e:
            batch = graphs is self._batch_graphs
            self._batches_ok = False
            if batch:
                self._forget_batches()
            else:
                self._graphs_ok = False
                self._forget_graphs()
            self.experts.forget()  # events recorded in the capture never ran
            what = "batched decode steps (one sequence's still replay)" if batch else "decode steps"
            warnings.warn(f"{what} could not be captured in a CUDA graph ({e}); running eagerly", stacklevel=3)

    def _forget_graphs(self) -> None:
        self._graphs.clear()
        self._forget_batches()

    def _forget_batches(self) -> None:
        if self._batch_graphs is not None:
            self._batch_graphs.close()
        self._batch_graphs = None

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] (float32, CPU) of a fresh sequence: the hook for reference comparisons."""
        return self.forward(list(tokens), self.new_cache(), all_logits=True).cpu()

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise MoestreamError("this model file has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode_prompt(prompt, chat)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Prefill the prompt, then decode up to params.max_tokens tokens, streaming text to on_text."""
        params = params or SamplingParams()
        prompt_tokens = self.encode_prompt(prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_tokens:
            raise MoestreamError("the prompt is empty")
        gen = Generation(prompt_tokens)
        sampler = Sampler(params)
        stream = TextStream(self.tokenizer) if self.tokenizer is not None else None
        if self._cache is None or self._cache.kv.n_ctx != self.n_ctx:
            self._cache = self.new_cache()
        cache = self._cache
        cache.reset()

        t0 = time.perf_counter()
        logits = self.forward(prompt_tokens, cache)
        token = sampler(logits[-1])
        gen.prefill_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            self._decode(gen, token, cache, sampler, stream, params, on_text)
        except KeyboardInterrupt as e:
            gen.stop_reason = "interrupted"
            gen.decode_s = time.perf_counter() - t0
            e.generation = gen  # what was generated so far, for the caller's report
            raise
        gen.decode_s = time.perf_counter() - t0
        return gen

    def _decode(self, gen: Generation, token: int, cache, sampler, stream, params, on_text) -> None:
        while params.max_tokens > 0:
            if params.stop_at_eos and self.tokenizer is not None and token in self.tokenizer.eos_ids:
                gen.stop_reason = "eos"
                break
            gen.tokens.append(token)
            if stream is not None:
                piece = stream.push(token)
                gen.text += piece
                if on_text and piece:
                    on_text(piece)
            if len(gen.tokens) >= params.max_tokens:
                break
            if cache.n_past >= self.n_ctx:
                gen.stop_reason = "context"
                break
            token = sampler(self.forward([token], cache)[-1])
        if stream is not None and (rest := stream.flush()):
            gen.text += rest
            if on_text:
                on_text(rest)

    def close(self) -> None:
        """Wait for copies, unpin, lift the VRAM cap, drop every view of the map, then close it."""
        try:
            if self.offload is not None:
                self.offload.close()
                cap_vram(self.device, None)
        finally:
            self._forget_graphs()
            self._cache = None
            self.offload = None
            self.model = None
            if self.source is not None:
                self.source.close()
                self.source = None
