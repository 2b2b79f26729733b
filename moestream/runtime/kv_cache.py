"""Per-sequence cache: keys and values of attention layers, allocated once for the whole context."""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError


class KVCache:
    """K and V for each attention layer: [n_ctx, Hkv, Dh], filled left to right (the VRAM budget counts them
    by offload/placement.kv_cache_bytes)."""

    def __init__(
        self,
        layers: list[int],
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.n_ctx = n_ctx
        shape = (n_ctx, n_head_kv, head_dim)
        self.k = {il: torch.zeros(shape, dtype=dtype, device=device) for il in layers}
        self.v = {il: torch.zeros(shape, dtype=dtype, device=device) for il in layers}

    def update(self, il: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, Hkv, Dh] at positions pos0.. and return everything up to pos0+T."""
        end = pos0 + k.shape[0]
        if end > self.n_ctx:
            raise MoestreamError(f"context full: position {end} exceeds the context size {self.n_ctx}; raise --ctx")
        self.k[il][pos0:end] = k
        self.v[il][pos0:end] = v
        return self.k[il][:end], self.v[il][:end]


class SequenceCache:
    """Everything one sequence carries between forward passes: attention KV and per-layer recurrent state."""

    def __init__(self, kv: KVCache, recurrent: dict | None = None):
        self.kv = kv
        self.recurrent = recurrent or {}  # il -> the architecture's state object (e.g. delta-net conv + S)
        self.n_past = 0  # tokens already in the cache
        self.broken = False  # set when a pass failed half-way

    def reset(self) -> None:
        """Start a new sequence in the same memory (captured decode steps that point at it stay valid)."""
        for state in self.recurrent.values():
            state.zero_()
        self.n_past = 0
        self.broken = False


def new_cache(model, n_ctx: int, dtype: torch.dtype, device: torch.device) -> SequenceCache:
    """An empty cache of n_ctx positions for one sequence of model."""
    s = model.spec
    kv = KVCache(model.attention_layers, n_ctx, s.n_head_kv, s.head_dim, dtype, device)
    return SequenceCache(kv, model.new_recurrent_state(device))
