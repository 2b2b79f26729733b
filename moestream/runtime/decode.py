"""One-token decode steps, replayed from CUDA graphs.

A decode step launches dozens of small kernels per layer; launched one by one from Python that costs more
than the GPU work (the last profile: 137 of 144 ms "busy" in launches). A static step (positions only on
the device, a fixed number of KV rows read under a mask, streamed experts picked on the device) queues the
same work every token, so it is captured once per sequence cache and key-count bucket and then replayed:
one launch per token. The first step of a bucket runs eagerly (it is also the warm-up that compiles the
Triton kernels), later ones replay; both run the same kernels, so they give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_KEYS = 256


def key_bucket(n_past: int, n_ctx: int) -> int:
    """KV rows a step at position n_past reads: a power of two from MIN_KEYS up, at most n_ctx.

    Few buckets (few captures) while short sequences do not read the whole context every token."""
    n = MIN_KEYS
    while n <= n_past:
        n *= 2
    return min(n, n_ctx)


Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x [1, D], positions [1], n_keys) -> logits


class _Captured:
    def __init__(self, graph, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, moved: int):
        self.graph, self.x, self.positions, self.out = graph, x, positions, out
        self.moved = moved  # expert bytes one replay reads over the link (no Python runs to count them)


class StepGraphs:
    """The captured steps of one sequence cache (they read and write its memory), one per key bucket.

    All buckets share one memory pool: only one of them runs at a time."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: dict[int, _Captured] = {}

    def __contains__(self, n_keys: int) -> bool:
        return n_keys in self.steps

    def capture(self, step: Step, x: torch.Tensor, positions: torch.Tensor, n_keys: int, experts) -> None:
        """Record step's kernels for this bucket (nothing runs): x and positions become its input buffers."""
        x, positions = x.clone(), positions.clone()
        graph = torch.cuda.CUDAGraph()
        before, stream = experts.bytes_moved, torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = step(x, positions, n_keys)
        finally:
            torch.cuda.set_stream(stream)  # a capture that failed can leave its side stream current
            moved = experts.bytes_moved - before
            experts.count_moved(-moved)  # capturing ran nothing
        self.steps[n_keys] = _Captured(graph, x, positions, out, moved)

    def replay(self, x: torch.Tensor, position: int, n_keys: int, experts) -> torch.Tensor:
        s = self.steps[n_keys]
        s.x.copy_(x)
        s.positions.fill_(position)
        s.graph.replay()
        experts.count_moved(s.moved)
        return s.out.clone()  # the next replay overwrites out
