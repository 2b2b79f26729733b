"""A GPU cache of the streamed layers' experts, in the VRAM a budget leaves (decode with prefetch).

A one-token step with streamed layers is link-bound once their experts are guessed ahead. An expert the cache
holds is one the link does not carry when it is guessed or missed: the prefetch and misses kernels read it
from the cache's rows instead.

Which experts (--cache-policy, offload/cache_policy.py, scored over the picks the misses kernel counts on the
device): static holds the most picked so far, refreshed between passes (a host sync, never inside a captured
step) after pass 1, 2, 4, ... then every REFRESH passes, reading the experts that changed over the link; lru and
lfu admit a picked expert the cache lacks in the step itself, copied on the device from the rows the step read it
into (no link bytes, no sync) over the least recently or least often picked one. Captured graphs read its rows and
its map in place, so they stay valid. The rows hold the file's bytes: cached or not, the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moestream.kernels import cache_admit
from moestream.kernels.gather import Cached, RowGather, copy_rows
from moestream.kernels.launch import INTERPRETED, triton
from moestream.offload.cache_policy import REFRESH, CachePolicy
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
        rows_for: Callable[[int], int] | None = None,
    ):
        self.tensors, self.n, self.pick = tensors, n, pick
        # rows it may hold beside KV caches of so many bytes (placement.cache_rows): n at first
        self.rows_for = rows_for or (lambda kv_bytes: n)
        self.layers = sorted(streamed)
        n_expert = tensors[self.layers[0]].n_expert
        self.stacks = {
            il: [torch.empty((n, *raw.shape[1:]), dtype=torch.uint8, device=device) for raw in tensors[il].host_bytes()]
            for il in self.layers
        }
        # each expert's row of the stacks (-1: not held), and a last column that writes for nobody land in
        self._map = torch.full((len(self.layers), n_expert + 1), -1, dtype=torch.long, device=device)
        self.slot_of = self._map[:, :n_expert]
        self.expert_of = torch.full((len(self.layers), n), -1, dtype=torch.long, device=device)  # each row's
        self.freq = torch.zeros((len(self.layers), n_expert), dtype=torch.long, device=device)  # picks so far
        self.policy = CachePolicy(policy, self.freq)
        self.row = {il: i for i, il in enumerate(self.layers)}
        self.passes = 0
        self.moved = 0  # bytes refreshes read over the link so far
        self.admitted = torch.zeros((), dtype=torch.long, device=device)  # bytes admissions copied on the device

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
        """A pass ended: the policy scores its picks (on the device); static, on schedule, holds each layer's
        most picked experts (a host sync). Returns the bytes the refresh read over the link."""
        self.passes += 1
        self.policy.end_pass()
        p = self.passes
        if not self.policy.admits and ((p & (p - 1) == 0 and p <= REFRESH) or p % REFRESH == 0):
            return self.refresh()
        return 0

    def admit(self, il: int, picks: torch.Tensor, first: torch.Tensor, rows: list[torch.Tensor], mats: torch.Tensor):
        """After layer il's picks [P] were read into rows (one tensor a stack; pick j's at mats[j]; first:
        first_picks(picks)): under lru / lfu each picked expert the cache lacks takes the row of the least worth
        held one, where it is worth more (never a row holding a pick of this pass), its bytes copied from rows.
        Device ops only (one launch on a GPU: kernels/cache_admit.py): no host sync, nothing over the link.
        Nothing under static, which follows the picks by its refreshes."""
        if not self.policy.admits:
            return
        i = self.row[il]
        if (picks.is_cuda or INTERPRETED) and triton is not None:
            score, lru, nbytes = self.policy.score[i], self.policy.name == "lru", self.tensors[il].expert_bytes
            args = self.slot_of[i], self.expert_of[i], score, lru, self.admitted, nbytes
            sources, to = cache_admit.admit(picks, first, mats, *args)
        else:
            sources, to = self._choose(i, picks, first, mats)
        for stack, src in zip(self.stacks[il], rows, strict=True):
            copy_rows(src, sources, stack, to)

    def _choose(self, i: int, picks: torch.Tensor, first: torch.Tensor, mats: torch.Tensor):
        """admit's choice and map updates in torch ops (the CPU device's): the picks the cache lacks, best
        worth first (ties: the lower expert), paired with the rows least worth keeping (ties: the lower row)."""
        slot_of, expert_of = self.slot_of[i], self.expert_of[i]
        n_expert, m = slot_of.numel(), min(picks.numel(), self.n)
        inf = torch.full((), float("inf"), dtype=torch.float64, device=picks.device)
        picked = torch.zeros(n_expert, dtype=torch.bool, device=picks.device).index_fill_(0, picks, True)
        held = expert_of.clamp(min=0)
        keep = torch.where(expert_of >= 0, self.policy.worth(i, held, picked=False), -inf)
        keep = torch.where((expert_of >= 0) & picked[held], inf, keep)
        keep, victim = keep.sort(stable=True)
        keep, victim = keep[:m], victim[:m]
        by_id = picks.argsort(stable=True)
        new = (first == torch.arange(picks.numel(), device=picks.device)) & (slot_of[picks] < 0)
        worth = torch.where(new, self.policy.worth(i, picks, picked=True), -inf)[by_id]
        worth, best = worth.sort(descending=True, stable=True)
        worth, chosen = worth[:m], by_id[best[:m]]
        take = worth > keep
        came, gone = picks[chosen], expert_of[victim]
        row_map, nobody = self._map[i], n_expert
        row_map.index_fill_(0, torch.where(take & (gone >= 0), gone, nobody), -1)
        row_map.scatter_(0, torch.where(take, came, nobody), victim)
        expert_of.index_copy_(0, victim, torch.where(take, came, gone))
        self.admitted += take.sum() * self.tensors[self.layers[i]].expert_bytes
        return mats[chosen], torch.where(take, victim, -1)

    def refresh(self) -> int:
        """Copy in the experts that became the best scored ones (a held one wins ties: no churn on equal
        scores); nothing before any pick was counted. Returns the bytes read over the link. The map first
        drops the rows about to be rewritten, so a refresh stopped half-way leaves no row named for an
        expert it no longer holds."""
        if not int(self.freq.sum()):
            return 0
        score = self.policy.ranking(self.slot_of >= 0)
        want = score.topk(self.n, dim=1).indices.tolist()
        holding = self.expert_of.tolist()
        moves = []  # (layer index, rows, new experts)
        for i, held in enumerate(holding):
            keep, have = set(want[i]), set(held)
            new = [e for e in want[i] if e not in have]
            if new:
                moves.append((i, [r for r, e in enumerate(held) if e not in keep][: len(new)], new))
        if not moves:
            return 0
        for i, rows, _ in moves:
            self.expert_of[i, rows] = -1
        self._write_map()
        moved = 0
        for i, rows, new in moves:
            il = self.layers[i]
            ids = torch.tensor(new, device=self.slot_of.device)
            at = torch.tensor(rows, device=self.slot_of.device)
            for raw, stack in zip(self.tensors[il].host_bytes(), self.stacks[il], strict=True):
                stack[at] = self.pick(raw, ids)
            self.expert_of[i, at] = ids
            moved += len(new) * self.tensors[il].expert_bytes
        self._write_map()
        self.moved += moved
        return moved

    def _write_map(self) -> None:
        """slot_of from expert_of (stream-ordered after the copies queued before it)."""
        nobody = self.slot_of.shape[1]
        rows = torch.arange(self.n, device=self._map.device).expand_as(self.expert_of)
        self._map.fill_(-1).scatter_(1, torch.where(self.expert_of >= 0, self.expert_of, nobody), rows)

    def resize(self, n: int) -> None:
        """Hold n rows a layer (at least 1): fewer drop the last rows' experts from the map, more add empty rows,
        one stack at a time (never a second copy of the whole cache). Steps captured over the rows must be
        dropped first: they read them in place."""
        keep = min(n, self.n)
        for stacks in self.stacks.values():
            for s, stack in enumerate(stacks):
                rows = stack.new_empty((n, *stack.shape[1:]))
                rows[:keep] = stack[:keep]
                stacks[s] = rows
        expert_of = self.expert_of.new_full((self.expert_of.shape[0], n), -1)
        expert_of[:, :keep] = self.expert_of[:, :keep]
        self.expert_of, self.n = expert_of, n
        self._write_map()

    def uncached(self, il: int, ids: torch.Tensor) -> torch.Tensor:
        """How many of experts ids layer il's cache does not hold (on the device: no sync)."""
        return (self.slots(il)[ids] < 0).sum()
