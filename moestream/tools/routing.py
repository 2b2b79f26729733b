"""Per-layer expert load: how many token-expert pairs each expert received."""

from __future__ import annotations

import torch

from moestream.ops.moe_swiglu import expert_counts


class RoutingCounter:
    """Counts the router's choices of every pass it is handed to (Engine.forward's on_route)."""

    def __init__(self, n_layer: int, n_expert: int):
        self.counts = torch.zeros(n_layer, n_expert, dtype=torch.int64)

    def __call__(self, il: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        self.counts[il] += expert_counts(ids.reshape(-1), self.counts.shape[1]).cpu()

    def imbalance(self) -> torch.Tensor:
        """Busiest expert's load over the mean load, per layer."""
        c = self.counts.float()
        return c.max(dim=1).values / c.mean(dim=1)


def routing_load(engine, n_tokens: int = 2048, seed: int = 0) -> RoutingCounter:
    """Run a prompt of random tokens and count each layer's expert load."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.spec.n_vocab, (n_tokens,), generator=g).tolist()
    counter = RoutingCounter(engine.spec.n_layer, engine.spec.n_expert)
    engine.forward(tokens, engine.new_cache(), on_route=counter)
    return counter
