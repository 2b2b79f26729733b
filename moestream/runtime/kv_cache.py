"""Per-sequence cache: keys and values of attention layers, allocated once for the whole context."""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError
from moestream.kernels import kv_quant
from moestream.ops.kv_rows import QuantizedRows
from moestream.options import KV_NAMES


class KVCache:
    """K and V for each attention layer: [n_ctx, Hkv, Dh], filled left to right (the VRAM budget counts them
    by offload/placement.kv_cache_bytes). Kept in the compute dtype as tensors, or, for another -ctk/-ctv type,
    as ops/kv_rows.QuantizedRows (blocks of Q8_0 / Q4_0, or another float dtype)."""

    def __init__(
        self,
        layers: list[int],
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        types: tuple[str, str] | None = None,
    ):
        self.n_ctx = n_ctx
        self.types = types or (KV_NAMES[str(dtype).removeprefix("torch.")],) * 2

        def rows(name: str) -> torch.Tensor | QuantizedRows:
            if kv_quant.FLOATS.get(name) == dtype:
                return torch.zeros((n_ctx, n_head_kv, head_dim), dtype=dtype, device=device)
            return QuantizedRows.empty(name, n_ctx, n_head_kv, head_dim, device)

        self.k = {il: rows(self.types[0]) for il in layers}
        self.v = {il: rows(self.types[1]) for il in layers}

    def update(self, il: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, Hkv, Dh] at positions pos0.. and return everything up to pos0+T."""
        end = pos0 + k.shape[0]
        if end > self.n_ctx:
            raise MoestreamError(f"context full: position {end} exceeds the context size {self.n_ctx}; raise --ctx")
        for store, rows in ((self.k[il], k), (self.v[il], v)):
            if isinstance(store, QuantizedRows):
                store.write(pos0, rows)
            else:
                store[pos0:end] = rows
        return self.k[il][:end], self.v[il][:end]

    def copy_prefix(self, src: KVCache, n: int) -> None:
        """The first n positions of every layer of src (a cache of the same model and types) into this one: a
        prompt's rows reused by another sequence."""
        if n > min(self.n_ctx, src.n_ctx) or src.types != self.types or src.k.keys() != self.k.keys():
            raise ValueError(f"{n} rows of a {src.types} cache copied into a {self.types} one of {self.n_ctx}")
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            for il, store in mine.items():
                if isinstance(store, QuantizedRows):
                    store.copy_rows(theirs[il], n)
                else:
                    store[:n].copy_(theirs[il][:n])


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


def new_cache(
    model, n_ctx: int, dtype: torch.dtype, device: torch.device, types: tuple[str, str] | None = None
) -> SequenceCache:
    """An empty cache of n_ctx positions for one sequence of model; types: K's and V's (None: dtype's)."""
    s = model.spec
    kv = KVCache(model.attention_layers, n_ctx, s.n_head_kv, s.head_dim, dtype, device, types)
    return SequenceCache(kv, model.new_recurrent_state(device))
