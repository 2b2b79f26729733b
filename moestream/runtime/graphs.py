"""Captured decode steps, cached: a CUDA graph per cache and key bucket (per set of caches and buckets for a
batch), replayed with new inputs; a freed cache takes its graphs along (runtime/step.py captures them)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch

from moestream.offload.counters import Counters

# Captured batch steps kept, the least recently replayed dropped first: a server's pool of 4 caches makes 11
# sets of two or more, times the key buckets they sit in. They share one memory pool, as a cache's one-token
# steps do (they never run at once); what each graph keeps there was not measured.
BATCH_GRAPHS = 32


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, D], positions [B]) -> logits [B, V]


class _Captured:
    def __init__(self, graph, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, moved: int, names):
        self.graph, self.x, self.positions, self.out = graph, x, positions, out
        self.moved = moved  # expert bytes one replay reads over the link (no Python runs to count them)
        self.names = names  # ids of the caches whose memory the graph reads and writes


class StepGraphs:
    """Captured steps that run one at a time, keyed by what fixes their kernels (a key bucket, or a batch's
    caches and buckets); all share one memory pool. Past `limit` entries the least recently replayed goes."""

    def __init__(self, limit: int | None = None):
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: dict[Hashable, _Captured] = {}
        self.limit = limit
        self._watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> its finalizer

    def __contains__(self, key: Hashable) -> bool:
        return key in self.steps

    def capture(
        self, step: Step, x: torch.Tensor, positions: torch.Tensor, key: Hashable, counters: Counters, watch=()
    ) -> None:
        """Record step's kernels under key (nothing runs): x and positions become its input buffers; the bytes
        the host counted while capturing are what each replay reads. watch: the caches the step touches, named
        in key by id; when one is freed, the steps naming it are dropped (before its id or its memory can be
        another's)."""
        self.steps.pop(key, None)
        if self.limit is not None and len(self.steps) >= self.limit:  # before: the peak holds no more than limit
            del self.steps[next(iter(self.steps))]
        if not self.steps:  # a pool whose graphs all died is not taken again (torch's allocator asserts on it
            self.pool = torch.cuda.graph_pool_handle()  # until its memory is released): seen in the load test
        x, positions = x.clone(), positions.clone()
        graph = torch.cuda.CUDAGraph()
        before, stream = counters.read_bytes, torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = step(x, positions)
        finally:
            torch.cuda.set_stream(stream)  # a capture that failed can leave its side stream current
            moved, counters.read_bytes = counters.read_bytes - before, before  # capturing ran nothing
        self.steps[key] = _Captured(graph, x, positions, out, moved, frozenset(id(c) for c in watch))
        for c in watch:
            if c not in self._watched:
                done = weakref.finalize(c, _drop_named, weakref.ref(self), id(c))
                done.atexit = False  # at exit nothing replays again; a server thread may still be replaying
                self._watched[c] = done

    def close(self) -> None:
        """Drop every step and stop watching caches (an engine forgetting its graphs)."""
        for done in self._watched.values():
            done.detach()
        self._watched.clear()
        self.steps.clear()

    def replay(self, x: torch.Tensor, positions: list[int], key: Hashable, counters: Counters) -> torch.Tensor:
        s = self.steps.pop(key)
        self.steps[key] = s  # the most recently used goes last, the first to be dropped first
        s.x.copy_(x)
        if len(positions) == 1:
            s.positions.fill_(positions[0])
        else:
            s.positions.copy_(torch.tensor(positions))
        s.graph.replay()
        counters.read_bytes += s.moved
        return s.out.clone()  # the next replay overwrites out

    def drop_named(self, cache_id: int) -> None:
        """Drop the steps that read the cache of this id (caches, and so this, belong to the engine's thread)."""
        for key in [k for k, s in self.steps.items() if cache_id in s.names]:
            self.steps.pop(key, None)


def _drop_named(graphs: weakref.ref, cache_id: int) -> None:
    """A watched cache was freed: its steps go with it (a weak reference, so graphs can go first)."""
    if (g := graphs()) is not None:
        g.drop_named(cache_id)
