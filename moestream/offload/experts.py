"""Where the MoE layer gets its experts from. The model asks; placement and streaming are decided here."""

from __future__ import annotations

from typing import Protocol

import torch

from moestream.models.layers import moe_swiglu


class ExpertSource(Protocol):
    def ffn(self, il: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for layer il: x [T, D], weights / ids [T, K] -> [T, D]."""
        ...


class ResidentExperts:
    """Every expert stack already dequantized on the compute device."""

    def __init__(self, stacks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.stacks = stacks  # il -> (gate [E, F, D], up [E, F, D], down [E, D, F])

    def ffn(self, il: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe_swiglu(x, weights, ids, *self.stacks[il])
