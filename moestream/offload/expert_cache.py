"""A GPU cache of the streamed layers' most-picked experts, in the VRAM a budget leaves (decode with prefetch).

A one-token step with streamed layers is link-bound once their experts are guessed ahead. An expert the cache
holds is one the link does not carry when it is guessed or missed: the prefetch and misses kernels read it
from the cache's rows instead.

Which experts: the best scored by the --cache-policy (offload/cache_policy.py) over the picks the misses kernel
counts on the device: the most picked so far (static), the most recently (lru) or lately (lfu). The cache is
refreshed between passes (a host sync, never inside a captured step) after pass 1, 2, 4, ... then every
policy.refresh_every passes; only experts that changed are copied. Captured graphs read its rows and its map in place,
so they stay valid. The rows hold the file's bytes: cached or not, the same tokens.
"""

from __future__ import annotations

import torch

from moestream.kernels.gather import Cached, RowGather
from moestream.offload.cache_policy import CachePolicy
from moestream.offload.expert_tensors import ExpertTensors


class ExpertCache:
    """n experts of each streamed layer on the device, with the map and pick counts the kernels use."""

    def __init__(
        self,
        tensors: dict[int, ExpertTensors],
        streamed: list[int],
        n: int,
        device: torch.device,
        pick: RowGather,
        policy: str = "static",
    ):
        self.tensors, self.n, self.pick = tensors, n, pick
        self.layers = sorted(streamed)
        n_expert = tensors[self.layers[0]].n_expert
        self.stacks = {
            il: [torch.empty((n, *raw.shape[1:]), dtype=torch.uint8, device=device) for raw in tensors[il].host_bytes()]
            for il in self.layers
        }
        self.slot_of = torch.full((len(self.layers), n_expert), -1, dtype=torch.long, device=device)
        self.freq = torch.zeros((len(self.layers), n_expert), dtype=torch.long, device=device)  # picks so far
        self.policy = CachePolicy(policy, self.freq)
        self.held = [[-1] * n for _ in self.layers]  # the expert in each row (host copy of slot_of)
        self.row = {il: i for i, il in enumerate(self.layers)}
        self.passes = 0
        self.moved = 0  # bytes refreshes read over the link so far

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for stacks in self.stacks.values() for s in stacks)

    def slots(self, il: int) -> torch.Tensor:
        """Layer il's map: each expert's row of its stacks (-1: not held)."""
        return self.slot_of[self.row[il]]

    def of(self, il: int, stack: int) -> Cached:
        """What the gather kernels take for one stack (gate, up, down) of layer il."""
        return self.stacks[il][stack], self.slots(il)

    def counts(self, il: int) -> torch.Tensor:
        """Layer il's pick counts (the misses kernel adds to them)."""
        return self.freq[self.row[il]]

    def end_pass(self) -> int:
        """A pass ended: the policy scores its picks (on the device); on schedule, hold each layer's best scored
        experts (a host sync). Returns the bytes the refresh read over the link."""
        self.passes += 1
        self.policy.end_pass()
        p, every = self.passes, self.policy.refresh_every
        if (p & (p - 1) == 0 and p <= every) or p % every == 0:
            return self.refresh()
        return 0

    def refresh(self) -> int:
        """Copy in the experts that became the best scored ones (a held one wins ties: no churn on equal
        scores); nothing before any pick was counted. Returns the bytes read over the link. The map first
        drops the rows about to be rewritten, so a refresh stopped half-way leaves no row named for an
        expert it no longer holds."""
        if not int(self.freq.sum()):
            return 0
        score = self.policy.ranking(self.slot_of >= 0)
        want = score.topk(self.n, dim=1).indices.tolist()
        moves = []  # (layer index, rows, new experts)
        for i, held in enumerate(self.held):
            keep, have = set(want[i]), set(held)
            new = [e for e in want[i] if e not in have]
            if new:
                moves.append((i, [r for r, e in enumerate(held) if e not in keep][: len(new)], new))
        if not moves:
            return 0
        for i, rows, _ in moves:
            for r in rows:
                self.held[i][r] = -1
        self._write_map()
        moved = 0
        for i, rows, new in moves:
            il = self.layers[i]
            ids = torch.tensor(new, device=self.slot_of.device)
            at = torch.tensor(rows, device=self.slot_of.device)
            for raw, stack in zip(self.tensors[il].host_bytes(), self.stacks[il], strict=True):
                stack[at] = self.pick(raw, ids)
            for r, e in zip(rows, new, strict=True):
                self.held[i][r] = e
            moved += len(new) * self.tensors[il].expert_bytes
        self._write_map()
        self.moved += moved
        return moved

    def _write_map(self) -> None:
        """slot_of from held (stream-ordered after the copies queued before it)."""
        slot_of = torch.full(self.slot_of.shape, -1, dtype=torch.long)
        for i, held in enumerate(self.held):
            for r, e in enumerate(held):
                if e >= 0:
                    slot_of[i, e] = r
        self.slot_of.copy_(slot_of)

    def uncached(self, il: int, ids: torch.Tensor) -> torch.Tensor:
        """How many of experts ids layer il's cache does not hold (on the device: no sync)."""
        return (self.slots(il)[ids] < 0).sum()
