"""The engine's placement lifecycle, in one place: the options it was built for, the offload they make
(offload/builder.py) and the decode step over its experts (runtime/step.py), rebuilt together when the
options change (bench and profile sweep placements), and for --small-batch auto rebuilt for the way measured
fastest (offload/small_batch.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from moestream.errors import MoestreamError
from moestream.offload.builder import Offload
from moestream.offload.expert_cache import ExpertCache
from moestream.offload.experts import LayerExperts
from moestream.offload.placement import kv_cache_bytes
from moestream.offload.small_batch import Measured, measure
from moestream.options import Options, SmallBatch
from moestream.profiling.timeline import NULL, Timeline
from moestream.runtime import way_memory
from moestream.runtime.kv_cache import SequenceCache, new_cache
from moestream.runtime.step import Capturing, DecodeStep, key_bucket

Build = Callable[[Options, Measured | None], Offload]  # options (and what auto measured) -> a placement


class Setup:
    """options, the offload built for them and the decode step over its experts; `measured`: what
    --small-batch auto timed for this placement (None: nothing)."""

    def __init__(self, model, options: Options, build: Build, file_id: str | None = None):
        self.model, self.options, self._build = model, options, build
        self.file_id = file_id  # the model file as way_memory knows it (None: auto's choices are not kept)
        self.n_ctx = options.model.context(model.spec.n_ctx_train)
        self.capturing = Capturing()  # a refused capture is not retried in a later placement
        self.timeline: Timeline = NULL
        self.measured: Measured | None = None
        self.offload: Offload | None = None
        self.step: DecodeStep | None = None
        self.caches: weakref.WeakSet[SequenceCache] = weakref.WeakSet()  # the sequences' KV caches alive now
        self._rebuild(options)

    @property
    def experts(self) -> LayerExperts:
        """Where each layer's experts come from, for the current placement."""
        return self.offload.experts

    def record(self, timeline: Timeline) -> None:
        """Send copy and compute spans of the following passes to timeline (NULL turns recording off)."""
        self.timeline = self.step.timeline = timeline
        self.experts.record(timeline)

    def reconfigure(self, **changes) -> None:
        """Change placement or schedule (n_cpu_moe, stream, slots, ubatch...) without reloading dense weights.

        On a bad change the engine keeps working with its previous options."""
        if "deltanet" in changes:  # the model chose its delta rule when it was built
            raise MoestreamError("the delta-net rule is chosen at load: load the model again with deltanet=...")
        options = self.options.replace(**changes)
        failed = None
        try:
            self._rebuild(options)
        except BaseException as e:
            failed = e.with_traceback(None)  # the traceback would keep the half-built placement's memory alive
        if failed is not None:
            self._rebuild(self.options)
            raise failed
        self.options = options
        self.settle()

    def settle(self) -> None:
        """--small-batch auto with a choice to make (offload/small_batch.py DecodePlan.measures): take what an
        earlier load of the same file with the same options timed on this machine (way_memory.py), or time a few
        decode steps each way the placement allows (unless measure_ways is off: the rule then stands), and build
        the placement for the fastest (fresh byte counts and expert cache, and the buffers that way needs; the
        rule's placement serves when it is that)."""
        self.measured = None
        if not self.offload.plan.measures() or len(tried := self.offload.ways()) < 2:
            return
        k = way_memory.key(self.file_id, self.options, tried) if self.file_id is not None else None
        measured = way_memory.recall(k) if k is not None else None
        if measured is None:
            if not self.options.decode.measure_ways:
                return  # the rule's placement stands
            measured = measure(tried, self._trial)
            if k is not None:
                way_memory.remember(k, measured)
        start = time.perf_counter()
        if measured.note and measured.chosen is self.offload.plan.way:  # remembered; no trial touched this one
            self.offload.experts.plan = dataclasses.replace(self.offload.plan, measured=measured)
        else:
            self._rebuild(self.options, measured)  # self.options stay auto
        self.measured = dataclasses.replace(measured, rebuilding=time.perf_counter() - start)
        if self.options.model.progress:
            print(self.measured.describe(), file=sys.stderr)

    def new_cache(self, positions: int | None = None) -> SequenceCache:
        """A sequence's KV cache, of the whole context or (positions) of the key bucket that holds so many. An auto
        expert cache holds the room the KV caches alive do not (placement.cache_rows): it is sized again beside
        them and this one first."""
        n = self.capacity(positions)
        self._fit(self._held_with(n))
        opts = self.options.model
        cache = new_cache(self.model, n, opts.torch_dtype, opts.torch_device, opts.kv_types)
        self.caches.add(cache)
        return cache

    def capacity(self, positions: int | None) -> int:
        """The positions new_cache(positions) gets: a power of two from the first key bucket up, at most -c."""
        return self.n_ctx if positions is None else key_bucket(max(positions, 1) - 1, self.n_ctx)

    def new_cache_shrinks(self, positions: int | None = None) -> bool:
        """Whether new_cache(positions) would shrink the expert cache (a server then reuses a free cache)."""
        cache = self._expert_cache()
        return cache is not None and cache.rows_for(self._held_with(self.capacity(positions))) < cache.n

    def _bytes(self, positions: int) -> int:
        """A KV cache of so many positions (and its recurrent state), as the footprint counts a whole one."""
        opts = self.options
        kv = dict(zip(("type_k", "type_v"), opts.model.kv_types, strict=True))
        size = functools.partial(kv_cache_bytes, self.model.spec, dtype=opts.model.torch_dtype, **kv)
        return self.offload.footprint.kv_cache // opts.serving.n_seqs - size(self.n_ctx) + size(positions)

    def kv_bytes(self) -> int:
        """Bytes of the KV caches alive now (a server's running and pooled ones)."""
        return sum(self._bytes(c.kv.n_ctx) for c in self.caches)

    def _held_with(self, positions: int) -> int:
        """Bytes of the KV caches alive now and a new one of so many positions."""
        return self.kv_bytes() + self._bytes(positions)

    def _expert_cache(self) -> ExpertCache | None:
        pf = self.offload.experts.prefetcher
        return pf.cache if pf is not None else None

    def _fit(self, kv_bytes: int) -> None:
        """Size the expert cache to what it may hold beside KV caches of kv_bytes (a server's small ones leave it
        more than a whole one does), the steps captured over its rows dropped first (they read them in place;
        the next step captures again)."""
        cache = self._expert_cache()
        if cache is not None and (rows := max(1, cache.rows_for(kv_bytes))) != cache.n:
            if self.step is not None:
                self.step.close()
            self.offload.dev.synchronize()  # no copy queued before still reads or writes the rows
            cache.resize(rows)

    @contextlib.contextmanager
    def _trial(self, way: SmallBatch) -> Iterator[Callable[[], None]]:
        """One-token steps of an empty sequence with this placement's small batches served `way` (greedy tokens,
        not zeros); they leave their traces in the placement (byte counts, the expert cache's picks)."""
        opts = self.options
        step = DecodeStep(self.model, self.offload.trial(way), opts.model.torch_dtype, self.capturing)
        cache = new_cache(self.model, self.n_ctx, opts.model.torch_dtype, opts.model.torch_device, opts.model.kv_types)
        # run reaches them through `live`, cleared when the trial ends: the caller may still hold run while the
        # next trial makes its cache, which must not sit beside this one (the budget counts one)
        live, token = [step, cache], 1

        @torch.inference_mode()
        def run() -> None:
            nonlocal token
            token = int(live[0].one(token, live[1])[-1].argmax())  # reading the token waits for the step

        try:
            yield run
        finally:
            step.close()
            live.clear()

    def _rebuild(self, options: Options, measured: Measured | None = None) -> None:
        """A new placement for options, the old one's captured steps, memory and page locks released first."""
        if self.step is not None:
            self.step.close()  # captured steps read the old expert buffers: their memory goes before the new
        self.step = None
        if self.offload is not None:
            self.offload.close()  # first: the new placement may page-lock the same ranges
        self.offload = None  # and let its device memory go before the new one is made
        self.offload = self._build(options, measured)
        if self.caches:  # sequences made before the rebuild keep their room (else it is sized beside a whole one)
            self._fit(self.kv_bytes())
        self.step = DecodeStep(self.model, self.offload.experts, options.model.torch_dtype, self.capturing)
        self.record(self.timeline)

    def close(self) -> None:
        """Wait for copies, unpin, and let the placement's memory (and the model's) go."""
        for unrolled in self.capturing.unrolled if self.file_id is not None else ():  # compiled here by now
            way_memory.remember_rows(way_memory.rows_key(self.file_id, self.options), unrolled)
        try:
            if self.offload is not None:
                self.offload.close()
        finally:
            if self.step is not None:
                self.step.close()
            self.offload = self.step = self.model = None
