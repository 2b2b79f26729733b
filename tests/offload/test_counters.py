"""Decode's counters: the device slots the gather kernels add to, read back by name, and the link bytes they
add to the streamer's uploads."""

from __future__ import annotations

import torch

from moestream.kernels.gather import Count
from moestream.offload.counters import Counters, PickStats


class _Uploads:
    bytes_uploaded = 1000


def test_pick_stats_read_the_slots_the_kernels_name():
    assert PickStats._fields == tuple(c.name.lower() for c in Count)
    c = Counters.of(_Uploads(), guesses=True, device=torch.device("cpu"))
    c.add(Count.GUESS_BYTES, 40)
    c.add(Count.GUESS_BYTES, torch.tensor(2))  # a device count (the cache's uncached guesses), no sync
    c.add_picks(picks=8, misses=3, miss_bytes=300, cached=1)
    c.read_bytes += 7
    assert c.stats() == PickStats(picks=8, misses=3, miss_bytes=300, guess_bytes=42, cached=1)
    assert c.bytes_moved == 1000 + 7 + 300 + 42


def test_without_guesses_nothing_counts_on_the_device():
    c = Counters.of(None, guesses=False, device=torch.device("cpu"))
    c.read_bytes += 5
    assert c.on_device is None and c.stats() is None and c.bytes_moved == 5
