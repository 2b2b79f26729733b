"""KV cache rows kept in another type than the compute dtype (-ctk/-ctv): `QuantizedRows`, and attention over
such rows a chunk of keys at a time, for devices without the decode kernel (the CPU), so no dequantized copy
of the whole cache is ever made.

Legend: T = queries, S = cache rows, H / Hkv = query / key-value heads, G = H / Hkv, Dh = head dim,
B = bytes a row (kernels/kv_quant.py).
"""

from __future__ import annotations

import math

import torch

from moestream.errors import MoestreamError
from moestream.kernels import kv_quant

CHUNK_ROWS = 1024
"""Cache rows row_attention dequantizes at once."""


class QuantizedRows:
    """Rows [S, Hkv, Dh] stored as type `name`: llama.cpp's blocks (uint8 [S, B], each row quantized as one
    row of Hkv * Dh values, as llama.cpp's cache does) or a float tensor [S, Hkv, Dh] of another dtype than
    the compute dtype. Slicing rows ([:n]) gives a view."""

    def __init__(self, name: str, data: torch.Tensor, heads: tuple[int, int]):
        self.name, self.data, self.heads = name, data, heads

    @classmethod
    def empty(cls, name: str, n_rows: int, n_head_kv: int, head_dim: int, device: torch.device) -> QuantizedRows:
        """Zeroed rows (zero blocks dequantize to zeros)."""
        if name in kv_quant.FLOATS:
            shape = (n_rows, n_head_kv, head_dim)
            return cls(name, torch.zeros(shape, dtype=kv_quant.FLOATS[name], device=device), (n_head_kv, head_dim))
        if head_dim % kv_quant.BLOCK:  # each head's values in whole blocks: the attention kernel reads them so
            raise MoestreamError(
                f"a {name} KV cache needs heads of a multiple of {kv_quant.BLOCK} values; this model's have "
                f"{head_dim}: use -ctk/-ctv f16"
            )
        width = kv_quant.row_bytes(name, n_head_kv * head_dim)
        return cls(name, torch.zeros((n_rows, width), dtype=torch.uint8, device=device), (n_head_kv, head_dim))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], *self.heads)

    @property
    def quantized(self) -> bool:
        return self.name in kv_quant.BLOCK_BYTES

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, rows: slice) -> QuantizedRows:
        return QuantizedRows(self.name, self.data[rows], self.heads)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, Hkv, Dh] as this store's rows (blocks or the float dtype)."""
        if self.quantized:
            return kv_quant.quantize(rows.reshape(rows.shape[0], -1), self.name)
        return rows.to(self.data.dtype)

    def write(self, at: int | torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [T, Hkv, Dh] at rows at.. (an int) or at the device positions at [T] (a static batch)."""
        _put(self.data, at, self.encode(rows))

    def copy_(self, src: QuantizedRows) -> QuantizedRows:
        """src's rows (as many as these: a store of the same type and heads, another sequence's cache or a copy
        of one) into these, in place, as torch's Tensor.copy_."""
        if (src.name, src.heads) != (self.name, self.heads):
            raise ValueError(f"rows of {src.name} {src.heads} copied into {self.name} {self.heads}")
        self.data.copy_(src.data)
        return self

    def to(self, device: torch.device | str, copy: bool = False) -> QuantizedRows:
        """These rows on device, as torch's Tensor.to (copy: always a new copy)."""
        return QuantizedRows(self.name, self.data.to(device, copy=copy), self.heads)

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..end-1 as values [end - start, Hkv, Dh] in dtype."""
        part = self.data[start:end]
        if not self.quantized:
            return part.to(dtype)
        return kv_quant.dequantize(part, self.name, dtype).view(end - start, *self.heads)


def write_rows(store: torch.Tensor | QuantizedRows, at: int | torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows [T, Hkv, Dh] in a KV cache's store (a tensor of the compute dtype or QuantizedRows) at rows
    at.. (an int: a prompt) or at the device positions at [T] (a static batch): every cache write goes here."""
    if isinstance(store, QuantizedRows):
        store.write(at, rows)
    else:
        _put(store, at, rows)


def _put(data: torch.Tensor, at: int | torch.Tensor, rows: torch.Tensor) -> None:
    if isinstance(at, int):
        data[at : at + rows.shape[0]] = rows
    else:
        data.index_copy_(0, at, rows)


def row_attention(
    q: torch.Tensor,
    k: QuantizedRows | torch.Tensor,
    v: QuantizedRows | torch.Tensor,
    positions: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """ops/attention.masked_attention over stored rows: q [T, H, Dh] over k, v (S rows), query t seeing keys
    0..positions[t] (the last `window` if nonzero), the heads' sinks [H] in each softmax if given. Keys come
    CHUNK_ROWS at a time, dequantized to float32, their softmaxes merged by running max and sum (float32
    throughout). Returns [T, H, Dh] in q's dtype."""
    T, H, Dh = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    rows = q.float().view(T, Hkv, G, Dh).transpose(0, 1).reshape(Hkv, T * G, Dh) / math.sqrt(Dh)  # row t*G+g
    pos = positions.repeat_interleave(G)[:, None]  # [T*G, 1]
    m = torch.full((Hkv, T * G), float("-inf"), device=q.device)
    total = torch.zeros((Hkv, T * G), device=q.device)
    acc = torch.zeros((Hkv, T * G, Dh), device=q.device)
    for lo in range(0, S, CHUNK_ROWS):
        hi = min(S, lo + CHUNK_ROWS)
        kc, vc = (_rows(c, lo, hi).transpose(0, 1) for c in (k, v))  # [Hkv, C, Dh]
        key = torch.arange(lo, hi, device=q.device)[None, :]
        visible = key <= pos
        if window:
            visible &= key > pos - window
        scores = (rows @ kc.transpose(1, 2)).masked_fill_(~visible, float("-inf"))  # [Hkv, T*G, C]
        m, total, acc = _merge(m, total, acc, scores, vc)
    if sinks is not None:  # one more logit a head, with no value
        sink = sinks.float().view(Hkv, 1, G).expand(Hkv, T, G).reshape(Hkv, T * G)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        total, acc = total * alpha + torch.exp(sink - m_new), acc * alpha[..., None]
    out = acc / total[..., None]
    return out.view(Hkv, T, G, Dh).transpose(0, 1).reshape(T, H, Dh).to(q.dtype)


def _rows(c: QuantizedRows | torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return c.dequantize(lo, hi, torch.float32) if isinstance(c, QuantizedRows) else c[lo:hi].float()


def _merge(
    m: torch.Tensor, total: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The running max, sum and weighted values with one more chunk's scores and values (rows with no visible
    key yet keep max -inf, sum 0)."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # no -inf - -inf
    p = torch.exp(scores - base[..., None])
    alpha = torch.exp(m - base)
    return m_new, total * alpha + p.sum(dim=-1), acc * alpha[..., None] + p @ values
