"""Per-layer expert load: how many token-expert pairs each expert received."""

from __future__ import annotations

import torch

from moestream.models.layers import expert_counts


class RoutingCounter:
    """Wraps an ExpertSource and counts the router's choices on their way through."""

    def __init__(self, inner, n_layer: int, n_expert: int):
        self.inner = inner
        self.counts = torch.zeros(n_layer, n_expert, dtype=torch.int64)

    def __getattr__(self, name: str):
        """The engine's streaming hooks (streams, begin, end_pass) go to the wrapped source unchanged."""
        return getattr(self.inner, name)

    def ffn(self, il: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.counts[il] += expert_counts(ids.reshape(-1), self.counts.shape[1]).cpu()
        return self.inner.ffn(il, x, weights, ids)

    def imbalance(self) -> torch.Tensor:
        """Busiest expert's load over the mean load, per layer."""
        c = self.counts.float()
        return c.max(dim=1).values / c.mean(dim=1)


def routing_load(engine, n_tokens: int = 2048, seed: int = 0) -> RoutingCounter:
    """Run a prompt of random tokens and count each layer's expert load."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.spec.n_vocab, (n_tokens,), generator=g).tolist()
    counter = RoutingCounter(engine.model.experts, engine.spec.n_layer, engine.spec.n_expert)
    engine.model.experts = counter
    try:
        engine.forward(tokens, engine.new_cache())
    finally:
        engine.model.experts = counter.inner
    return counter
