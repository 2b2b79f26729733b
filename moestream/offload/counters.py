"""What serving experts cost: bytes over the link and decode's pick counts, kept apart from the dispatch that
causes them (offload/experts.py) and read by bench, the server and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from moestream.kernels.gather import Count

if TYPE_CHECKING:
    from moestream.offload.shards import ShardedStreamer
    from moestream.offload.streamer import Streamer


class PickStats(NamedTuple):
    """The device counters read back, a field a slot of kernels/gather.py's Count, in its order."""

    picks: int
    misses: int  # picks the guess did not name, gathered after routing
    miss_bytes: int  # bytes those read over the link
    guess_bytes: int  # bytes the guesses read over the link
    cached: int  # picks the expert cache held


@dataclass
class Counters:
    """One placement's decode counters. on_device: int64 [len(Count)], what the gathers count without a host
    sync (their kernels add to it in place), None where decode does not guess (nothing counts there);
    read_bytes: expert bytes the host knows were read over the link besides the streamer's own uploads
    (expert-cache refreshes, replayed steps' share); gathered: int64 [] on the device, bytes the gathers
    without a guess read (each picked expert once a pass, however many rows picked it: the count stays on the
    device, in captured steps too); usage: while a list, each streamed micro-batch's fraction of experts used
    (bench)."""

    streamer: Streamer | ShardedStreamer | None  # counts its own uploads (None: nothing streams)
    on_device: torch.Tensor | None = None
    read_bytes: int = 0
    usage: list[torch.Tensor] | None = None
    gathered: torch.Tensor | None = None

    @classmethod
    def of(cls, streamer: Streamer | ShardedStreamer | None, guesses: bool, device: torch.device) -> Counters:
        """Counters beside streamer, with device slots where decode guesses."""
        slots = torch.zeros(len(Count), dtype=torch.long, device=device) if guesses else None
        return cls(streamer, slots, gathered=torch.zeros((), dtype=torch.long, device=device))

    def add_gathered(self, first: torch.Tensor, expert_bytes: int) -> None:
        """Count a gather of the picks whose first_picks are first: each expert's bytes once (queued)."""
        if self.gathered is None:
            self.gathered = torch.zeros((), dtype=torch.long, device=first.device)
        distinct = (first == torch.arange(first.numel(), device=first.device)).sum()
        self.gathered += distinct * expert_bytes

    def add(self, slot: Count, n: int | torch.Tensor) -> None:
        """Add to one device slot (queued: a tensor n stays on the device)."""
        self.on_device[slot] += n

    def add_picks(self, picks: int, misses: int, miss_bytes: int, cached: int) -> None:
        """The counts of picks the host made (the gather kernels could not): one device add."""
        counts = [0] * len(Count)
        counts[Count.PICKS], counts[Count.MISSES], counts[Count.MISS_BYTES] = picks, misses, miss_bytes
        counts[Count.CACHED] = cached
        self.on_device += torch.tensor(counts, device=self.on_device.device)

    def stats(self) -> PickStats | None:
        """The device counts so far (a sync); None where decode does not guess."""
        return None if self.on_device is None else PickStats(*self.on_device.tolist())

    @property
    def bytes_moved(self) -> int:
        """Expert bytes sent over the link so far: whole-layer uploads, picked experts, gathers, prefetched
        guesses and their misses (those counted on the device: reading them is a sync)."""
        s = self.stats()
        moved = self.streamer.bytes_uploaded if self.streamer is not None else 0
        gathered = int(self.gathered) if self.gathered is not None else 0
        return moved + self.read_bytes + gathered + (s.miss_bytes + s.guess_bytes if s is not None else 0)
