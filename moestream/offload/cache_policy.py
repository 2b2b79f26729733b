"""Which experts the decode expert cache holds (--cache-policy): each policy keeps a score per expert of each
cached layer, on the device.

- static: picks counted since load (what the prompt and the first tokens picked: a fixed popular set), the best
  scored held after refreshes between passes (experts read over the link);
- lru: the pass each expert was last picked in: every picked expert the cache lacks is admitted in the step,
  copied from the rows the step read it into, over the least recently picked one;
- lfu: picks with a decay of DECAY a pass (a half-life of about 14 tokens): a picked expert the cache lacks is
  admitted as with lru when its score with this pick beats the weakest held one's.

Scores are updated after each pass by device ops on the pick counts the misses kernel keeps, admissions by
device ops in the step, so the step (and its captured graph) waits on nothing; only static's refresh, between
steps, reads scores back to the host.
"""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError
from moestream.options import CACHE_POLICIES as POLICIES

DECAY = 0.95  # lfu's weight of one pass's picks against the next's
REFRESH = 32  # static's passes between refreshes once warm


class CachePolicy:
    """The scores of one policy over counts [layers, experts] (cumulative picks, the misses kernel's)."""

    def __init__(self, name: str, counts: torch.Tensor):
        if name not in POLICIES:
            raise MoestreamError(f"--cache-policy {name}: choose {', '.join(POLICIES)}")
        self.name, self.counts = name, counts
        self.admits = name != "static"  # the cache follows the picks in the step, not by refreshes
        self.seen = counts.clone()  # counts at the end of the last pass
        dtype = torch.float32 if name == "lfu" else torch.long
        self.score = counts if name == "static" else torch.zeros(counts.shape, dtype=dtype, device=counts.device)
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
        """static's refresh: counts to take the top of, held [layers, experts] bool: a held expert wins a tie
        (no churn)."""
        return self.score * 2 + held.long()

    def worth(self, layer: int, experts: torch.Tensor, picked: bool) -> torch.Tensor:
        """What holding experts (ids, on the device) of cache layer `layer` is worth (float64): with picked,
        counting the pick of this pass (lru: the newest of all; lfu: one more pick)."""
        score = self.score[layer][experts].double()
        if picked:
            return torch.full_like(score, float("inf")) if self.name == "lru" else score + 1
        return score
