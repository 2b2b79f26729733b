"""Which experts the decode expert cache holds (--cache-policy): each policy keeps a score per expert of each
cached layer, on the device, and the cache holds the best scored ones at its next refresh.

- static: picks counted since load (what the prompt and the first tokens picked: a fixed popular set);
- lru: the pass each expert was last picked in (recent picks win);
- lfu: picks with a decay of DECAY a pass (popular lately wins; a half-life of about 14 tokens).

The score is updated after each pass by device ops on the pick counts the misses kernel keeps, so the step
(and its captured graph) waits on nothing; only the refresh, between steps, reads scores back to the host.
"""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError
from moestream.options import CACHE_POLICIES as POLICIES

DECAY = 0.95  # lfu's weight of one pass's picks against the next's
REFRESH = {"static": 32, "lru": 4, "lfu": 4}  # passes between refreshes once warm: recent policies follow more


class CachePolicy:
    """The scores of one policy over counts [layers, experts] (cumulative picks, the misses kernel's)."""

    def __init__(self, name: str, counts: torch.Tensor):
        if name not in POLICIES:
            raise MoestreamError(f"--cache-policy {name}: choose {', '.join(POLICIES)}")
        self.name, self.counts = name, counts
        self.refresh_every = REFRESH[name]
        self.seen = counts.clone()  # counts at the end of the last pass
        dtype = torch.float32 if name == "lfu" else torch.long
        self.score = torch.zeros(counts.shape, dtype=dtype, device=counts.device)
        self.passes = 0

    def end_pass(self) -> None:
        """Fold the pass's picks into the score (device ops only)."""
        self.passes += 1
        if self.name == "static":
            return
        picked = self.counts - self.seen  # [layers, experts] this pass's picks
        if self.name == "lru":
            self.score.masked_fill_(picked > 0, self.passes)
        else:
            self.score.mul_(DECAY).add_(picked)
        self.seen.copy_(self.counts)

    def ranking(self, held: torch.Tensor) -> torch.Tensor:
        """Scores to take the top of, held [layers, experts] bool: a held expert wins a tie (no churn)."""
        if self.name == "static":
            return self.counts * 2 + held.long()
        if self.name == "lru":  # last use, then picks so far, then held
            return (self.score * (self.counts.max() + 1) + self.counts) * 2 + held.long()
        return self.score + held.float() * 1e-3
