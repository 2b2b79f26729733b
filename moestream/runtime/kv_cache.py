"""Per-sequence cache: keys and values of attention layers, allocated once for the whole context."""

from __future__ import annotations

from dataclasses import dataclass

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

    def rows(self, n: int, device: torch.device | str | None = None) -> KVRows:
        """Rows 0..n of every layer: views of this cache (valid until they are written again), or copies on
        device. Callers copy rows through here and put_rows, never by slicing k and v themselves, so the
        layout of a row stays this class's business."""
        rows = KVRows(self.n_ctx, self.k, self.v).first(n)
        return rows if device is None else rows.to(device)

    def put_rows(self, rows: KVRows) -> None:
        """Write rows (from rows() of a cache of the same model) at positions 0..rows.n, in place: captured
        decode steps that point at this cache stay valid."""
        if rows.n > self.n_ctx or rows.k.keys() != self.k.keys():
            raise MoestreamError(f"KV rows 0..{rows.n} of other layers or a longer context cannot go in this cache")
        for il in self.k:
            self.k[il][: rows.n].copy_(rows.k[il])
            self.v[il][: rows.n].copy_(rows.v[il])


@dataclass
class KVRows:
    """The first n rows of every attention layer's K and V, apart from their cache (a prompt cache's copy)."""

    n: int
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for rows in (self.k, self.v) for t in rows.values())

    def first(self, n: int) -> KVRows:
        """The first n of these rows (views)."""
        if not 0 <= n <= self.n:
            raise MoestreamError(f"KV rows 0..{n} asked of a copy of {self.n}")
        return KVRows(n, {il: t[:n] for il, t in self.k.items()}, {il: t[:n] for il, t in self.v.items()})

    def to(self, device: torch.device | str) -> KVRows:
        """A copy on device."""
        copy = {il: t.to(device, copy=True) for il, t in self.k.items()}
        return KVRows(self.n, copy, {il: t.to(device, copy=True) for il, t in self.v.items()})


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
