"""x times a dense weight (transposed), the weight a float tensor or quantized blocks as the file stores them.

A few tokens multiply straight from the stored blocks, with no dequantized copy: on a GPU through
`kernels/matvec.py` (several weights of one x in one launch), on the CPU through the compiled
`kernels/cpu_quant.py`. Otherwise the weight is dequantized and multiplied, each row on its own for a few rows
(a batched decode step gives each sequence the bits of its step alone).

Legend: T = tokens, D = input width, N = output rows (a head's: the vocabulary), F = a shared expert's width.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from moestream.kernels import cpu_quant, matvec, moe_matvec, tuning
from moestream.kernels.dequant import dequantize

HEAD_ROWS = 32768
"""Output-head rows dequantized at once: the whole head of a 248k vocabulary in bf16 would be ~1 GiB."""


class Stored(NamedTuple):
    """A quantized weight [N, D] as the file stores it: its blocks' bytes on the compute device, type, shape."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape, dtype)


Weight = torch.Tensor | Stored
"""A dense weight as the ops take it: a float tensor in the compute dtype, or stored blocks."""


def reads_directly(x: torch.Tensor, w: Weight) -> bool:
    """Whether linear(x, w) multiplies from the stored blocks on a GPU (no dequantized copy is made)."""
    return isinstance(w, Stored) and matvec.usable(w.qtype, x.device, x.shape[0])


def cpu_reads(x: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether the compiled CPU matvec multiplies x [T, D] on the CPU by blocks of this type: a few tokens (as
    many as a GPU's matvec takes), each row on its own, so a batched step gives each sequence its bits alone."""
    return (
        x.device.type == "cpu"
        and 0 < x.shape[0] <= tuning.current().max_tokens
        and qtype in cpu_quant.TYPES
        and cpu_quant.available()
    )


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, D] @ w.T in x's dtype; for a few tokens straight from the stored blocks."""
    if isinstance(w, Stored):
        if matvec.usable(w.qtype, x.device, x.shape[0]):
            return matvec.matvec(w.raw, w.qtype, w.shape[0], x)
        if cpu_reads(x, w.qtype):
            return cpu_quant.matvec(w.raw, w.qtype, w.shape[0], x).to(x.dtype)
        w = w.dequantize(x.dtype)
    return matvec.linear_each_row(x, w)


def linears(x: torch.Tensor, ws: list[Weight]) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws]; for a few tokens on a GPU, one launch for all (a layer's q, k and v)."""
    parts = [_matvec_part(x, w) for w in ws]
    if 2 <= len(ws) <= 4 and all(parts):
        return matvec.matvecs(parts, x)
    return [linear(x, w) for w in ws]


def _matvec_part(x: torch.Tensor, w: Weight) -> tuple[torch.Tensor, GGMLQuantizationType, int] | None:
    """What matvec.matvecs needs of w for x, if the matvec reads it (stored blocks, or a float weight in x's
    dtype)."""
    if isinstance(w, Stored):
        return (w.raw, w.qtype, w.shape[0]) if matvec.usable(w.qtype, x.device, x.shape[0]) else None
    return matvec.float_part(w) if matvec.reads_float(x, w) else None


def swiglu(x: torch.Tensor, gate: Weight, up: Weight) -> torch.Tensor:
    """silu(x gate.T) * (x up.T), h [T, F] (a shared expert before its down projection): one launch from the
    stored blocks when the matvec reads both and they are stored alike."""
    if reads_directly(x, gate) and reads_directly(x, up) and gate.qtype == up.qtype:
        return moe_matvec.swiglu(x, [gate.raw, up.raw], (gate.qtype, up.qtype), gate.shape[0])
    return F.silu(linear(x, gate)) * linear(x, up)


def head_logits(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, D] times the output head w [N, D] (N the vocabulary): logits [T, N]. A decode step reads the stored
    head once (on a GPU or the CPU); otherwise HEAD_ROWS rows are dequantized at a time, one slice alive at a time."""
    if isinstance(w, Stored) and (reads_directly(x, w) or cpu_reads(x, w.qtype)):
        return linear(x, w)
    out = x.new_empty(x.shape[0], w.shape[0])
    start = 0
    for rows in row_chunks(w, HEAD_ROWS, x.dtype):
        out[:, start : start + rows.shape[0]] = matvec.linear_each_row(x, rows)  # a decode batch: as each alone
        start += rows.shape[0]
        del rows
    return out


def row_chunks(w: Weight, rows: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """w [N, D] in slices of `rows` rows, each dequantized (to dtype) only when reached: a 248k-token vocabulary
    in bf16 is ~1 GiB, more than the rest of a micro-batch's temporaries; slices keep the peak at one slice
    (quantized rows are whole blocks, so they slice cleanly)."""
    if not isinstance(w, Stored):
        yield from w.split(rows)
        return
    flat = w.raw.reshape(-1)  # the map gives one row of bytes per weight row
    per_row = flat.numel() // w.shape[0]
    for start in range(0, w.shape[0], rows):
        n = min(rows, w.shape[0] - start)
        yield dequantize(flat[start * per_row : (start + n) * per_row], w.qtype, (n, *w.shape[1:]), dtype)
