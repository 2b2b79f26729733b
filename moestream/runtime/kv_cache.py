"""Per-sequence cache: keys and values of attention layers, allocated once for the whole context."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.kernels import kv_quant
from moestream.ops.kv_rows import QuantizedRows, write_rows
from moestream.options import KV_NAMES

Rows = torch.Tensor | QuantizedRows
"""One layer's K or V rows: a tensor in the compute dtype, or another -ctk/-ctv type's."""


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

        def rows(name: str) -> Rows:
            if kv_quant.FLOATS.get(name) == dtype:
                return torch.zeros((n_ctx, n_head_kv, head_dim), dtype=dtype, device=device)
            return QuantizedRows.empty(name, n_ctx, n_head_kv, head_dim, device)

        self.k = {il: rows(self.types[0]) for il in layers}
        self.v = {il: rows(self.types[1]) for il in layers}

    def update(self, il: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[Rows, Rows]:
        """Store k, v [T, Hkv, Dh] at positions pos0.. and return everything up to pos0+T."""
        end = pos0 + k.shape[0]
        if end > self.n_ctx:
            raise MoestreamError(f"context full: position {end} exceeds the context size {self.n_ctx}; raise --ctx")
        write_rows(self.k[il], pos0, k)
        write_rows(self.v[il], pos0, v)
        return self.k[il][:end], self.v[il][:end]

    def rows(self, n: int, device: torch.device | str | None = None) -> KVRows:
        """Rows 0..n of every layer as this cache keeps them: views (valid until they are written again), or
        copies on device. Callers copy rows through here and copy_prefix, never by slicing k and v themselves,
        so the layout of a row stays this class's and ops/kv_rows.QuantizedRows' business."""
        rows = KVRows(self.n_ctx, self.types, self.k, self.v).first(n)
        return rows if device is None else rows.to(device)

    def copy_prefix(self, rows: KVRows) -> None:
        """rows (rows() of a cache of the same model and types: another sequence's, or a copy in host RAM) at
        positions 0..rows.n, in place: a prompt's rows reused by another sequence, and captured decode steps that
        point at this cache stay valid."""
        if rows.n > self.n_ctx or rows.types != self.types or rows.k.keys() != self.k.keys():
            raise ValueError(f"{rows.n} rows of a {rows.types} cache copied into a {self.types} one of {self.n_ctx}")
        for mine, theirs in ((self.k, rows.k), (self.v, rows.v)):
            for il, store in mine.items():
                store[: rows.n].copy_(theirs[il])


@dataclass
class KVRows:
    """The first n rows of every attention layer's K and V as their cache keeps them (K's and V's types: tensors
    of the compute dtype or QuantizedRows), apart from it: a prompt cache's copy."""

    n: int
    types: tuple[str, str]
    k: dict[int, Rows]
    v: dict[int, Rows]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for rows in (self.k, self.v) for t in rows.values())

    def first(self, n: int) -> KVRows:
        """The first n of these rows (views)."""
        if not 0 <= n <= self.n:
            raise MoestreamError(f"KV rows 0..{n} asked of a copy of {self.n}")
        k, v = ({il: t[:n] for il, t in rows.items()} for rows in (self.k, self.v))
        return KVRows(n, self.types, k, v)

    def to(self, device: torch.device | str) -> KVRows:
        """A copy on device."""
        k, v = ({il: t.to(device, copy=True) for il, t in rows.items()} for rows in (self.k, self.v))
        return KVRows(self.n, self.types, k, v)


_SERIALS = itertools.count()


class SequenceCache:
    """Everything one sequence carries between forward passes: attention KV and per-layer recurrent state."""

    def __init__(self, kv: KVCache, recurrent: dict | None = None):
        self.kv = kv
        self.recurrent = recurrent or {}  # il -> the architecture's state object (e.g. delta-net conv + S)
        self.n_past = 0  # tokens already in the cache
        self.broken = False  # set when a pass failed half-way
        self.serial = next(_SERIALS)  # the order of creation: batched rows sorted by it come in the same order each run

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
