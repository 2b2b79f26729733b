"""Next-layer prefetch for decode steps: the link works while the GPU computes, instead of after it.

A gathered layer's experts are known only once its router has run, so without a guess each streamed layer's
gather waits for its attention, and its experts' compute waits for the gather: the step costs compute plus
link. The residual stream changes little from one layer to the next, so the experts layer L+1's router picks
for layer L's input are mostly the ones it picks for its own. Those are gathered on a side stream (Device.side)
while layer L runs; after L+1's real routing a guessed pick reads the prefetched rows and a missed one is
gathered then, with no host sync. A wrong guess costs link bytes, never correctness: the rows hold the same
experts' bytes.

A pass of several rows (a server's running batch, a token for each sequence) guesses for each row and gathers
the union of the guesses, each expert once, into a slot part of a fixed width for that many rows (repeats pad
it and are not read); a missed expert is read once, by its first pick, however many rows picked it.

How far ahead (--prefetch-ahead): a streamed layer's guess is made at the start of the streamed layer 1 (the
default) or 2 before it, from that layer's input with the guessed layer's router: at 2 the link has two layers'
compute to hide behind, and a trained model's guess names ~4 points fewer of its picks. The first `ahead` streamed
layers are guessed together, at the start of the layer before the first (from the embedding for layer 0). The ring
has ahead + 1 slots, used in turn; the side stream first waits for everything compute queued before it, so a slot
is rewritten (for the streamed layer ahead + 1 later, at the start of the one after its reader) only after the
layer that read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kernels import tuning
from moestream.kernels.gather import Count, RowGather, fill_misses, first_picks, union
from moestream.offload.counters import Counters
from moestream.offload.device import Device
from moestream.offload.expert_cache import ExpertCache
from moestream.offload.expert_tensors import ExpertTensors
from moestream.profiling.timeline import NULL, Timeline

# Where a streamed layer's guess is made, `ahead` layers before it: at the start of the layer that many before
# ("layer"), or of the streamed layer that many before ("streamed", the default: earlier where resident layers
# sit between, so the side stream has the next gather queued before the current one ends). ahead + 1 slots
# suffice for both: a slot is next written for the streamed layer ahead + 1 later, queued after its last reader.
LEAD = "streamed"


@dataclass(frozen=True)
class _Guessed:
    """A pass's part of a slot, by its number of rows R: each stack's rows (width guessed, then one a pick), the
    guess (the union of the R rows' guesses: n_live distinct ids, then repeats of them), each pick's row of the
    stacks, and where the gather reads each guess. The same tensors every pass of R rows: a captured step's."""

    rows: list[torch.Tensor]
    guess: torch.Tensor  # [width]
    n_live: torch.Tensor  # [] on the device
    mats: torch.Tensor  # [R * K]
    offs: torch.Tensor  # [3, width]


class _Slot:
    """Rows for `width` guessed plus n_picks missed experts of each stack (gate, up, down) for the largest pass;
    a pass of fewer rows uses the front of each (part)."""

    def __init__(self, sizes: list[int], width: int, n_picks: int, device: torch.device, ready):
        self.bufs = [torch.empty((width + n_picks) * size, dtype=torch.uint8, device=device) for size in sizes]
        self.guess = torch.zeros(width, dtype=torch.long, device=device)
        self.n_live = torch.zeros((), dtype=torch.long, device=device)
        self.mats = torch.zeros(n_picks, dtype=torch.long, device=device)  # each pick's row of the stacks
        self.offs = torch.zeros(3 * width, dtype=torch.long, device=device)  # where a held guess is read
        self.ready = ready  # the side stream's event: the guess's rows are written

    def part(self, raws: list[torch.Tensor], width: int, n_picks: int) -> _Guessed:
        rows = [
            buf[: (width + n_picks) * raw[0].numel()].view(-1, *raw.shape[1:])
            for buf, raw in zip(self.bufs, raws, strict=True)
        ]
        offs = self.offs[: 3 * width].view(3, width)
        return _Guessed(rows, self.guess[:width], self.n_live, self.mats[:n_picks], offs)


class Prefetcher:
    """The guessed experts of gathered layers, `ahead` streamed layers ahead (--prefetch-ahead), for static
    passes of a token for each of up to `rows` sequences (a decode step, a server's running batch): the rows'
    guesses united, each expert read once, and their misses read once however many rows picked them."""

    def __init__(
        self,
        tensors: dict[int, ExpertTensors],
        streamed: list[int],
        n_guess: int,
        n_used: int,
        dev: Device,
        pick: RowGather,
        cache: ExpertCache | None = None,
        rows: int = 1,
        ahead: int = 1,
    ):
        self.tensors, self.n_guess, self.n_used, self.pick, self.dev = tensors, n_guess, n_used, pick, dev
        self.cache = cache  # experts held on the device: read there, not over the link
        self.rows = rows  # the most a pass guesses for (the ring is sized for them)
        self.ahead = ahead  # streamed layers between a guess and the layer it guesses (--prefetch-ahead)
        self.n_expert = tensors[streamed[0]].n_expert
        self.side = dev.side()  # the gathers' stream
        self.ring = {il: i % (ahead + 1) for i, il in enumerate(sorted(streamed))}  # layer -> its slot
        sizes, width = stack_sizes(tensors, streamed), self.width(rows)
        self.slots = [_Slot(sizes, width, rows * n_used, dev.device, self.side.event()) for _ in range(ahead + 1)]
        self.unheld = torch.full((self.n_expert,), -1, dtype=torch.long, device=dev.device)  # no cache's map
        self.pending: dict[int, _Guessed] = {}  # layer -> its part of a slot, the guessed rows queued

    def width(self, n_rows: int) -> int:
        """Guessed experts a pass of n_rows gathers: the union of the rows' guesses (slot_width)."""
        return slot_width(self.n_guess, n_rows, self.n_expert)

    def schedule(self) -> dict[int, list[int]]:
        """{layer at whose start guesses are made (-1: before layer 0, from the embedding): the layers guessed,
        in order}: each `ahead` layers (or streamed layers) before, the first ones before the first."""
        order, n = sorted(self.ring), self.ahead
        plan: dict[int, list[int]] = {}
        for i, il in enumerate(order):
            at = (order[i - n] if i >= n else order[0] - 1) if LEAD == "streamed" else max(il - n, -1)
            plan.setdefault(at, []).append(il)
        return plan

    def prefetch(self, il: int, guess: torch.Tensor, counters: Counters, timeline: Timeline = NULL) -> None:
        """Queue the gather of layer il's guessed experts (guess [R, G]: each row's ids, on the device; the
        union gathered, each expert once) on the side stream (a "copy" span of the timeline); the bytes it reads
        over the link are counted on the device."""
        slot, raws, n_rows = self.slots[self.ring[il]], self.tensors[il].host_bytes(), guess.shape[0]
        part = slot.part(raws, self.width(n_rows), n_rows * self.n_used)
        ids, n_live = union(guess.reshape(-1), part.guess.numel())
        part.guess.copy_(ids)
        part.n_live.copy_(n_live)
        nbytes = part.guess.numel() * self.tensors[il].expert_bytes  # at most: the timeline's span
        with self.side.after_compute():
            with timeline.span("copy", "prefetch", layer=il, nbytes=nbytes):
                self._gather(il, raws, part, counters)
            self.side.record(slot.ready)
        self.pending[il] = part

    def _gather(self, il: int, raws: list, part: _Guessed, counters: Counters) -> None:
        """The distinct guessed experts' rows of each stack, held ones read from the cache."""
        cache, width = self.cache, part.guess.numel()
        programs = tuning.current().gather_programs
        outs = [r[:width] for r in part.rows]
        if all(self.pick.reads(raw, part.guess) for raw in raws):
            try:  # one launch says where each guess is read (host or cache; repeats nowhere), then the gathers
                held = (cache.stacks[il], cache.slots(il)) if cache is not None else (outs, self.unheld)
                self.pick.gather_held(
                    raws, part.guess, part.n_live, outs, *held, counters.on_device, part.offs, programs
                )
                return
            except Exception as e:  # as RowGather: say it once, then pick through the host
                self.pick.failed(e)
        for s, (raw, out) in enumerate(zip(raws, outs, strict=True)):
            held = cache.of(il, s) if cache is not None else None
            self.pick(raw, part.guess, out=out, programs=programs, cache=held)
        link = torch.arange(width, device=part.guess.device) < part.n_live  # the distinct ones
        if cache is not None:
            link &= cache.slots(il)[part.guess] < 0
        counters.add(Count.GUESS_BYTES, link.sum() * self.tensors[il].expert_bytes)

    def take(self, il: int, ids: torch.Tensor, counters: Counters) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Layer il's stacks holding the experts ids [R, K] picked, and each pick's row of them (shaped as
        ids): guessed picks from the prefetch, missed ones gathered now, each missed expert once."""
        part, ready = self.pending.pop(il), self.slots[self.ring[il]].ready
        picks = ids.reshape(-1)
        first = first_picks(picks)  # a missed expert is read by its first pick, the others index that row
        raws = self.tensors[il].host_bytes()
        self.dev.wait(ready)  # compute waits for the guess's gather (no host sync)
        cache = self.cache
        held = [cache.of(il, s) if cache is not None else None for s in range(len(raws))]
        if all(self.pick.reads(raw, picks) for raw in raws):
            try:
                freq = cache.counts(il) if cache is not None else None
                for s, (raw, r) in enumerate(zip(raws, part.rows, strict=True)):
                    args = part.guess, part.n_live, r, part.mats, counters.on_device, s == 0, held[s], freq
                    fill_misses(raw, picks, first, *args)
                self._admit(il, picks, first, part.rows, part.mats)
                return part.rows, part.mats.view_as(ids)
            except Exception as e:  # as RowGather: say it once, then pick through the host
                self.pick.failed(e)
        width, n = part.guess.numel(), picks.numel()
        hit = (picks[:, None] == part.guess[None, :]) & (torch.arange(width, device=ids.device) < part.n_live)
        found = hit.any(1)
        mats = torch.where(found, hit.int().argmax(1), width + first)
        missed = (~found & (first == torch.arange(n, device=ids.device))).nonzero().view(-1)
        # a host sync above: the CPU device, or a GPU whose gather kernel failed
        for s, (raw, r) in enumerate(zip(raws, part.rows, strict=True)):
            r[width + missed] = self.pick(raw, picks[missed], cache=held[s])
        n_cached = 0
        if cache is not None:
            cache.counts(il).index_add_(0, picks, torch.ones_like(picks))
            n_cached = n - int(cache.uncached(il, picks))
        n_link = missed.numel() if cache is None else int(cache.uncached(il, picks[missed]))
        counters.add_picks(n, int((~found).sum()), n_link * self.tensors[il].expert_bytes, n_cached)
        self._admit(il, picks, first, part.rows, mats)
        return part.rows, mats.view_as(ids)

    def _admit(self, il: int, picks: torch.Tensor, first: torch.Tensor, rows: list[torch.Tensor], mats) -> None:
        """The cache (if any) takes what its policy admits of the picks from the rows just read."""
        if self.cache is not None:
            self.cache.admit(il, picks, first, rows, mats)

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


def slot_width(n_guess: int, n_rows: int, n_expert: int) -> int:
    """Guessed experts a slot holds for a pass of n_rows: every row's guess (the union, padded with repeats to
    this fixed width: a captured step's shapes stay), at most every expert of the layer."""
    return min(n_guess * n_rows, n_expert)


def stack_sizes(tensors: dict[int, ExpertTensors], layers) -> list[int]:
    """The bytes of one expert of each stack (gate, up, down), the largest over layers."""
    return [max(tensors[il].views[s].nbytes // tensors[il].n_expert for il in layers) for s in range(3)]


def ring_bytes(
    tensors: dict[int, ExpertTensors], layers, n_guess: int, n_used: int, rows: int = 1, ahead: int = 1
) -> int:
    """Device bytes of the ring for guesses over these layers, passes of up to `rows` rows, made `ahead`
    streamed layers ahead (what the placement budgets)."""
    n_expert = tensors[next(iter(layers))].n_expert
    return (ahead + 1) * (slot_width(n_guess, rows, n_expert) + rows * n_used) * sum(stack_sizes(tensors, layers))
