"""The engine: micro-batched prefill in token- or layer-major order, and generation, over a model whose experts
live wherever the placement put them (the decode step: runtime/step.py; the placement's lifecycle:
runtime/setup.py)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.tokenizer import TextStream
from moestream.offload.builder import Offload
from moestream.offload.device import cap_vram
from moestream.offload.experts import LayerExperts, OnRoute
from moestream.options import Options, Schedule
from moestream.profiling.timeline import Timeline
from moestream.runtime.kv_cache import SequenceCache
from moestream.runtime.sampling import Sampler, SamplingParams
from moestream.runtime.setup import Setup
from moestream.runtime.step import DecodeStep


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"  # length | eos | context | interrupted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # one-token passes after the prompt's (which gives the first token)

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        """Decode passes a second (0 with none: one token comes from the prompt's pass, not from decode)."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s else 0.0


class Engine:
    """Prefill order and generation over a model; the placement, its experts and the decode step come from
    setup (runtime/setup.py), which bench and profile reconfigure."""

    def __init__(self, model, tokenizer, setup: Setup, source=None):
        self.model = model
        self.setup = setup  # placement, decode step and device resources, closed with the engine
        self.spec = model.spec
        self.tokenizer = tokenizer
        self.source = source  # the open GGUF file the weights map, closed with the engine
        self.n_ctx = setup.n_ctx
        asked = setup.options.model.n_ctx
        if asked > self.n_ctx:
            warnings.warn(
                f"--ctx {asked} is more than the {self.n_ctx} positions the model was trained for; using {self.n_ctx}",
                stacklevel=2,
            )
        self._cache: SequenceCache | None = None  # generate()'s, reused so its captured steps are too

    @property
    def options(self) -> Options:
        return self.setup.options

    @property
    def offload(self) -> Offload:
        return self.setup.offload

    @property
    def experts(self) -> LayerExperts:
        """Where each layer's experts come from, for the current placement."""
        return self.setup.experts

    @property
    def step(self) -> DecodeStep:
        """The decode step over the current placement's experts."""
        return self.setup.step

    def record(self, timeline: Timeline) -> None:
        """Send copy and compute spans of the following passes to timeline (NULL turns recording off)."""
        self.setup.record(timeline)

    @property
    def device(self) -> torch.device:
        return self.options.model.torch_device

    @property
    def dtype(self) -> torch.dtype:
        return self.options.model.torch_dtype

    def _require_open(self) -> None:
        if self.model is None:
            raise MoestreamError("this engine is closed; load the model again")

    def new_cache(self, positions: int | None = None) -> SequenceCache:
        """A sequence's cache: of the whole context, or (a server's) of about `positions` (Setup.new_cache)."""
        self._require_open()
        return self.setup.new_cache(positions)

    def new_cache_shrinks(self, positions: int | None = None) -> bool:
        """Whether new_cache would take room the expert cache holds now (a server reuses a free cache instead)."""
        return self.setup.new_cache_shrinks(positions)

    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int],
        cache: SequenceCache,
        all_logits: bool = False,
        on_route: OnRoute | None = None,
        on_layer: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run tokens through the model in micro-batches of options.model.ubatch, appending to cache.

        Token-major runs each micro-batch through every layer; layer-major runs every micro-batch through
        layer L before layer L+1, so each streamed layer crosses the link once per prompt. Both compute
        exactly what chunked prefill computes. Returns logits [T, V] if all_logits else [1, V]. on_route sees
        each layer's MoE input and routing (a single token then runs as a prefill, not a decode step); on_layer
        each layer's input, the residual stream a guess-ahead reads (called before the layer's on_route).
        """
        self._check(tokens, cache)
        if len(tokens) == 1 and on_route is None and on_layer is None:
            return self.step.one(tokens[0], cache)
        ub, n_layer, experts = self.options.model.ubatch, self.spec.n_layer, self.experts
        chunks = [tokens[i : i + ub] for i in range(0, len(tokens), ub)]
        if self.options.streaming.stream is Schedule.LAYER_MAJOR and len(chunks) > 1:
            order = [(il, j) for il in range(n_layer) for j in range(len(chunks))]
            visits = [il for il in range(n_layer) if any(experts.streams(il, len(c)) for c in chunks)]
        else:
            order = [(il, j) for j in range(len(chunks)) for il in range(n_layer)]
            visits = [il for c in chunks for il in range(n_layer) if experts.streams(il, len(c))]
        show = self.options.model.progress and len(chunks) > 1
        # Inputs first: their small host-to-device copies would otherwise wait behind the expert uploads on the
        # copy engine, and compute start only after the first layers had arrived.
        make = self.model.make_batch
        batches = [make(cache.n_past + i * ub, len(c), self.device, self.dtype) for i, c in enumerate(chunks)]
        xs = [self.model.embed(torch.tensor(c)) for c in chunks]  # token ids stay on the host: rows are read there
        timeline = self.setup.timeline
        keep = self.options.streaming.keeps_dequantized(len(tokens), ub)
        p = experts.begin(visits, timeline=timeline, on_route=on_route, keep_dequantized=keep)
        started = False
        try:
            # on a terminal only (tqdm's None): a server's log would get a bar for every long prompt
            for il, j in tqdm(order, desc="prefill", unit="layer", disable=None if show else True, leave=False):
                p.start_layer(il, j)
                started = True
                if on_layer is not None:
                    on_layer(il, xs[j])
                xs[j] = self.model.layer(il, xs[j], batches[j], cache, p)
        except BaseException:
            if started:  # some layers' KV / recurrent state already moved on: the cache is unusable
                cache.broken = True
            raise
        finally:
            p.end()
        cache.n_past += len(tokens)
        with timeline.span("compute", "head"):
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
        if cache.n_past + len(tokens) > cache.kv.n_ctx:  # the context, or a server sequence's share of it
            raise MoestreamError(
                f"the prompt needs {cache.n_past + len(tokens)} positions but the context is {cache.kv.n_ctx} "
                f"(--ctx, at most the {self.spec.n_ctx_train} the model was trained for); raise --ctx up to "
                "that or shorten the prompt"
            )
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.spec.n_vocab:
            raise MoestreamError(f"token ids must be in [0, {self.spec.n_vocab}); got {min(tokens)}..{max(tokens)}")

    @torch.inference_mode()
    def forward_each(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """One token for each of several sequences in one pass (a server's running batch): the projections
        and experts run once for all rows, attention and recurrent state per sequence (DecodeStep.each).
        Returns logits [B, V]."""
        if not tokens or len(tokens) != len(caches) or len({id(c) for c in caches}) != len(caches):
            raise MoestreamError("forward_each takes one token for each of distinct sequences")
        for token, cache in zip(tokens, caches, strict=True):
            self._check([token], cache)
        return self.step.each(tokens, caches)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] (float32, CPU) of a fresh sequence: the hook for reference comparisons."""
        return self.forward(list(tokens), self.new_cache(), all_logits=True).cpu()

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise MoestreamError("this model file has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode_prompt(prompt, chat, self.n_ctx)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Prefill the prompt, then decode up to params.max_tokens tokens (-1: until the end of text or a full
        context), streaming text to on_text."""
        params = params or SamplingParams()
        prompt_tokens = self.encode_prompt(prompt, chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_tokens:
            raise MoestreamError("the prompt is empty")
        gen = Generation(prompt_tokens)
        sampler = Sampler(params, prompt_tokens)
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
        while params.limit > 0:
            if params.stop_at_eos and self.tokenizer is not None and token in self.tokenizer.eos_ids:
                gen.stop_reason = "eos"
                break
            gen.tokens.append(token)
            if stream is not None:
                piece = stream.push(token)
                gen.text += piece
                if on_text and piece:
                    on_text(piece)
            if len(gen.tokens) >= params.limit:
                break
            if cache.n_past >= cache.kv.n_ctx:
                gen.stop_reason = "context"
                break
            token = sampler(self.forward([token], cache)[-1])
            gen.decode_steps += 1
        if stream is not None and (rest := stream.flush()):
            gen.text += rest
            if on_text:
                on_text(rest)

    def close(self) -> None:
        """Wait for copies, unpin, lift the VRAM cap, drop every view of the map, then close it."""
        try:
            if self.setup.offload is not None:
                self.setup.close()
                cap_vram(self.device, None)
        finally:
            self._cache = None
            self.model = None
            if self.source is not None:
                self.source.close()
                self.source = None
