"""Expert parallel over several devices: each streamed layer's experts are split into ranges of ids, and each
range goes up through its own device's link into its own ring of staging slots and is computed there.

One PCIe link bounds prefill with streamed experts; N devices have N links. Attention, the dense weights and
the resident layers stay on the first device; for a streamed layer the first device sends each device the rows
routed to its range, and takes the products back (ops/moe_swiglu.moe_swiglu_sharded). A ShardedStreamer looks
like one Streamer to the expert source: the same visit plan drives every device's ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.offload.streamer import HostLayer, Streamer


def expert_ranges(n_expert: int, split: tuple[float, ...]) -> list[tuple[int, int]]:
    """Consecutive id ranges [lo, hi), one a device, sized in proportion to split (llama.cpp's --tensor-split:
    weights, not fractions; checked by the options). A device whose share rounds to nothing gets an empty range."""
    total, ranges, lo, acc = sum(split), [], 0, 0.0
    for w in split:
        acc += w
        hi = round(n_expert * acc / total)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def shard_layer(layer: HostLayer, lo: int, hi: int) -> HostLayer:
    """Experts lo..hi-1 of a streamed layer: views of the same host bytes (expert stacks are [E, ...])."""
    return HostLayer([part[lo:hi] for part in layer.parts])


@dataclass
class ShardedLayer:
    """A streamed layer on its devices: (lo, hi, stored bytes of experts lo..hi-1 on that device) each."""

    parts: list[tuple[int, int, list[torch.Tensor]]]


class ShardedStreamer:
    """The Streamer interface over one Streamer per device, each carrying one range of every layer's experts."""

    def __init__(self, streamers: list[Streamer], ranges: list[tuple[int, int]]):
        self.streamers = streamers
        self.ranges = ranges

    def begin(self, visits: list[int]) -> None:
        for s in self.streamers:
            s.begin(visits)

    def acquire(self, il: int) -> ShardedLayer:
        return ShardedLayer([(lo, hi, s.acquire(il)) for s, (lo, hi) in zip(self.streamers, self.ranges, strict=True)])

    def release(self, il: int) -> None:
        for s in self.streamers:
            s.release(il)

    def finish(self) -> None:
        for s in self.streamers:
            s.finish()

    def forget(self) -> None:
        for s in self.streamers:
            s.forget()

    def held(self, il: int) -> ShardedLayer | None:
        """Layer il if every device's ring already holds its range of it (as Streamer.held), else None."""
        parts = [s.held(il) for s in self.streamers]
        if any(p is None for p in parts):
            return None
        return ShardedLayer([(lo, hi, p) for (lo, hi), p in zip(self.ranges, parts, strict=True)])

    def upload_experts(self, il: int, experts: list[int]) -> None:
        """Small batches do not upload across devices: the caller computes elsewhere."""
        return None

    def close(self) -> None:
        for s in self.streamers:
            s.close()

    @property
    def slots(self) -> list:
        """The first device's ring (every device has as many slots, each a range's worth of bytes)."""
        return self.streamers[0].slots

    @property
    def uploads(self) -> int:
        return sum(s.uploads for s in self.streamers)

    @property
    def link_bytes(self) -> list[int]:
        """Bytes each device's link carried into its ring."""
        return [s.bytes_uploaded for s in self.streamers]

    @property
    def bytes_uploaded(self) -> int:
        return sum(self.link_bytes)

    @property
    def timeline(self):
        return self.streamers[0].timeline

    @timeline.setter
    def timeline(self, timeline) -> None:
        for s in self.streamers:
            s.timeline = timeline
