"""Next-layer prefetch for decode steps: the link works while the GPU computes, instead of after it.

A gathered layer's experts are known only once its router has run, so without a guess each streamed layer's
gather waits for its attention, and its experts' compute waits for the gather: the step costs compute plus
link. The residual stream changes little from one layer to the next, so the experts layer L+1's router picks
for layer L's input are mostly the ones it picks for its own. Those are gathered on a side stream (Device.side)
while layer L runs; after L+1's real routing a guessed pick reads the prefetched rows and a missed one is
gathered then, with no host sync. A wrong guess costs link bytes, never correctness: the rows hold the same
experts' bytes.

The side stream first waits for everything compute queued before it, so a slot is rewritten only after the
layer that read it.
"""

from __future__ import annotations

import torch

from moestream.kernels.gather import Count, RowGather, fill_misses
from moestream.offload.counters import Counters
from moestream.offload.device import Device
from moestream.offload.expert_cache import ExpertCache
from moestream.offload.expert_tensors import ExpertTensors
from moestream.profiling.timeline import NULL, Timeline

RING = 2
PROGRAMS = 16  # gather programs on the side stream: a program waiting on the link holds a multiprocessor
# Where a streamed layer's guess is made: at the start of the layer before it ("layer"), or of the streamed
# layer before it ("streamed", the default: earlier where resident layers sit between, so the side stream has
# the next gather queued before the current one ends). Two slots suffice for both: a slot is next written for
# the streamed layer after next, queued after its last reader.
LEAD = "streamed"


class _Slot:
    """Rows for G guessed plus n missed experts of each stack (gate, up, down), and the guess."""

    def __init__(self, sizes: list[int], n_guess: int, n_picks: int, device: torch.device, ready):
        self.bufs = [torch.empty((n_guess + n_picks) * size, dtype=torch.uint8, device=device) for size in sizes]
        self.guess = torch.zeros(n_guess, dtype=torch.long, device=device)
        self.mats = torch.zeros(n_picks, dtype=torch.long, device=device)  # each pick's row of the stacks
        self.ready = ready  # the side stream's event: the guess's rows are written
        self.offs = torch.zeros((3, n_guess), dtype=torch.long, device=device)  # where a held guess is read


class Prefetcher:
    """The guessed experts of gathered layers, a layer or so ahead, for one-token static passes."""

    def __init__(
        self,
        tensors: dict[int, ExpertTensors],
        streamed: list[int],
        n_guess: int,
        n_used: int,
        dev: Device,
        pick: RowGather,
        cache: ExpertCache | None = None,
    ):
        self.tensors, self.n_guess, self.n_used, self.pick, self.dev = tensors, n_guess, n_used, pick, dev
        self.cache = cache  # experts held on the device: read there, not over the link
        self.side = dev.side()  # the gathers' stream
        self.ring = {il: i % RING for i, il in enumerate(sorted(streamed))}  # layer -> its slot
        sizes = stack_sizes(tensors, streamed)
        self.slots = [_Slot(sizes, n_guess, n_used, dev.device, self.side.event()) for _ in range(RING)]
        self.pending: dict[int, list[torch.Tensor]] = {}  # layer -> its stacks' rows, the guessed ones queued

    def schedule(self) -> dict[int, int]:
        """{layer at whose start a guess is made (-1: before layer 0, from the embedding): the layer guessed}."""
        order = sorted(self.ring)
        lead = LEAD == "streamed"
        return {(order[i - 1] if lead and i else il - 1): il for i, il in enumerate(order)}

    def prefetch(self, il: int, guess: torch.Tensor, counters: Counters, timeline: Timeline = NULL) -> None:
        """Queue the gather of layer il's guessed experts (guess [G] ids, on the device) on the side stream (a
        "copy" span of the timeline); the bytes it reads over the link are counted on the device."""
        slot, raws = self.slots[self.ring[il]], self.tensors[il].host_bytes()
        slot.guess.copy_(guess.reshape(-1))
        rows = [
            buf[: (self.n_guess + self.n_used) * raw[0].numel()].view(-1, *raw.shape[1:])
            for buf, raw in zip(slot.bufs, raws, strict=True)
        ]
        nbytes = self.n_guess * self.tensors[il].expert_bytes  # at most: the timeline's span
        with self.side.after_compute():
            with timeline.span("copy", "prefetch", layer=il, nbytes=nbytes):
                self._gather(il, raws, slot, [r[: self.n_guess] for r in rows], counters)
            self.side.record(slot.ready)
        self.pending[il] = rows

    def _gather(self, il: int, raws: list, slot: _Slot, outs: list[torch.Tensor], counters: Counters) -> None:
        """The guessed rows of each stack into outs, held ones read from the cache."""
        cache = self.cache
        if cache is not None and all(self.pick.reads(raw, slot.guess) for raw in raws):
            try:  # one launch says where each guess is read (host or cache), then the usual gathers
                held = cache.stacks[il], cache.slots(il)
                self.pick.gather_held(raws, slot.guess, outs, *held, counters.on_device, slot.offs, PROGRAMS)
                return
            except Exception as e:  # as RowGather: say it once, then pick through the host
                self.pick.failed(e)
        for s, (raw, out) in enumerate(zip(raws, outs, strict=True)):
            held = cache.of(il, s) if cache is not None else None
            self.pick(raw, slot.guess, out=out, programs=PROGRAMS, cache=held)
        link = self.n_guess if cache is None else cache.uncached(il, slot.guess)
        counters.add(Count.GUESS_BYTES, link * self.tensors[il].expert_bytes)

    def take(self, il: int, ids: torch.Tensor, counters: Counters) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Layer il's stacks holding the experts ids [T, K] picked, and each pick's row of them (shaped as
        ids): guessed picks from the prefetch, missed ones gathered now."""
        rows, slot = self.pending.pop(il), self.slots[self.ring[il]]
        picks = ids.reshape(-1)
        raws = self.tensors[il].host_bytes()
        self.dev.wait(slot.ready)  # compute waits for the guess's gather (no host sync)
        cache = self.cache
        held = [cache.of(il, s) if cache is not None else None for s in range(len(raws))]
        if all(self.pick.reads(raw, picks) for raw in raws):
            try:
                freq = cache.counts(il) if cache is not None else None
                for s, (raw, r) in enumerate(zip(raws, rows, strict=True)):
                    fill_misses(raw, picks, slot.guess, r, slot.mats, counters.on_device, s == 0, held[s], freq)
                return rows, slot.mats.view_as(ids)
            except Exception as e:  # as RowGather: say it once, then pick through the host
                self.pick.failed(e)
        hit = picks[:, None] == slot.guess[None, :]
        found = hit.any(1)
        mats = torch.where(found, hit.int().argmax(1), self.n_guess + torch.arange(picks.numel(), device=ids.device))
        missed = (~found).nonzero().view(-1)  # a host sync: the CPU device, or a GPU whose gather kernel failed
        for s, (raw, r) in enumerate(zip(raws, rows, strict=True)):
            r[self.n_guess + missed] = self.pick(raw, picks[missed], cache=held[s])
        n_cached = 0
        if cache is not None:
            cache.counts(il).index_add_(0, picks, torch.ones_like(picks))
            n_cached = picks.numel() - int(cache.uncached(il, picks))
        n_link = missed.numel() if cache is None else int(cache.uncached(il, picks[missed]))
        counters.add_picks(picks.numel(), missed.numel(), n_link * self.tensors[il].expert_bytes, n_cached)
        return rows, mats.view_as(ids)

    def drop(self) -> None:
        """Forget guesses nobody took (a pass that stopped half-way), after compute has waited for their
        gathers: a later pass, or a replayed graph, must not race a gather still writing a slot."""
        for il in self.pending:
            self.dev.wait(self.slots[self.ring[il]].ready)
        self.pending.clear()

    def forget(self) -> None:
        """Drop guesses and their events after a failed graph capture: those events never ran (waiting on one
        is an error), and the slots hold nothing anyone will take."""
        self.dev.synchronize()
        self.pending.clear()
        for slot in self.slots:
            slot.ready = self.side.event()


def stack_sizes(tensors: dict[int, ExpertTensors], layers) -> list[int]:
    """The bytes of one expert of each stack (gate, up, down), the largest over layers."""
    return [max(tensors[il].views[s].nbytes // tensors[il].n_expert for il in layers) for s in range(3)]


def ring_bytes(tensors: dict[int, ExpertTensors], layers, n_guess: int, n_used: int) -> int:
    """Device bytes of the ring for guesses over these layers (what the placement budgets)."""
    return RING * (n_guess + n_used) * sum(stack_sizes(tensors, layers))
