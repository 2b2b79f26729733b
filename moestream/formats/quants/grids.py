"""The IQ grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): each group of 8 (IQ3: 4) values
is one row of a fixed grid picked by an index, with a sign pattern (IQ1: a shift of +-1/8 instead) and a
scale per 16 or 32 values.

The grids and the sign table come from gguf.quants (its classes decode them); `grid` and `sign_bytes` turn
them into torch tensors once per device, and `kernel_table` into the words the Triton kernels read.
"""

from __future__ import annotations

import functools

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import f16, split_bits

# The 7-bit sign indices of IQ2_XXS, IQ2_XS and IQ3_XXS name 8-bit patterns with an even count of minus signs
KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)


def grid_values(qtype: Q) -> np.ndarray:
    """The grid of an IQ type as gguf decodes it: float32 [rows, 8] (IQ3: [rows, 4]); IQ1_M shares IQ1_S's."""
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)


@functools.cache
def grid(qtype: Q, device: torch.device) -> torch.Tensor:
    """grid_values on device (made once per device)."""
    return torch.from_numpy(grid_values(qtype).copy()).to(device)


@functools.cache
def sign_bytes(device: torch.device) -> torch.Tensor:
    """The 256 sign patterns as float32 [256, 8] of +-1 (bit j set: element j negative), then the 128 patterns
    of the 7-bit indices, as rows 256.."""
    bits = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    table = np.where(bits == 0, np.float32(1), np.float32(-1))
    return torch.from_numpy(np.concatenate([table, table[KSIGNS]])).to(device)


@functools.cache
def kernel_table(qtype: Q, device: torch.device) -> torch.Tensor:
    """The int32 words the Triton kernels read for qtype (kernels/dequant.py, dots.py): each grid row's values as
    bfloat16 (exact: small integers, or +-1 and 0 for IQ1), two a word, low half first. The kernels make the
    signs from the blocks' sign bytes themselves."""
    halves = (grid_values(qtype).view(np.uint32) >> 16).reshape(-1, 2)  # float32 -> bfloat16, exact here
    return torch.from_numpy((halves[:, 0] | (halves[:, 1] << 16)).view(np.int32).copy()).to(device)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2m) bytes -> (n, m) little-endian 16-bit fields as int32."""
    b = b.to(torch.int32).reshape(b.shape[0], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(n, 4m) bytes -> (n, m) little-endian 32-bit fields as int64."""
    b = b.to(torch.int64).reshape(b.shape[0], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """(n, m) bytes -> (n, 2m) 4-bit fields, each byte's low nibble first."""
    return split_bits(b, 4, 2).transpose(1, 2).reshape(b.shape[0], -1)


def _signed(qtype: Q, scale: torch.Tensor, index: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """scale * grid[index] * sign for n blocks of 256: scale (n, k) per 256 / k values, index (n, 256 / width)
    grid rows, signs (n, 32) sign_bytes rows (one per 8 values), in gguf's order of products."""
    n = scale.shape[0]
    g = grid(qtype, scale.device)[index.long()].reshape(n, scale.shape[1], -1)
    s = sign_bytes(scale.device)[signs.long()].reshape(n, scale.shape[1], -1)
    return (scale[..., None] * g * s).reshape(n, 256)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS (66 B / 256): d f16, then per 32 values two 32-bit words: 4 grid indices (bytes), then 4 7-bit
    sign indices and a 4-bit scale (top); x = d (1/2 + s) / 4 * grid * sign."""
    aux = _u32(b[:, 2:66]).reshape(-1, 8, 2)
    db = f16(b, 0) * (0.5 + (aux[..., 1] >> 28).to(torch.float32)) * 0.25
    signs = 256 + ((aux[..., 1:] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127)
    return _signed(Q.IQ2_XXS, db, b[:, 2:66].reshape(-1, 8, 8)[..., :4], signs)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """IQ2_XS (74 B / 256): d f16, 32 16-bit fields (9-bit grid index, 7-bit sign index), a 4-bit scale per 16."""
    qs = _u16(b[:, 2:66])
    db = f16(b, 0) * (0.5 + _nibbles(b[:, 66:74]).to(torch.float32)) * 0.25
    return _signed(Q.IQ2_XS, db, qs & 511, 256 + (qs >> 9))


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    """IQ2_S (82 B / 256): d f16, grid index low bytes[32], sign bytes[32], 2 high index bits a group
    (qh[8]), a 4-bit scale per 16."""
    high = split_bits(b[:, 66:74], 2, 4).transpose(1, 2).reshape(-1, 32).to(torch.int32)
    db = f16(b, 0) * (0.5 + _nibbles(b[:, 74:82]).to(torch.float32)) * 0.25
    return _signed(Q.IQ2_S, db, b[:, 2:34].to(torch.int32) | (high << 8), b[:, 34:66])


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """IQ3_XXS (98 B / 256): d f16, 64 grid indices (4 values each), then per 32 values a 32-bit word: 4 7-bit
    sign indices and a 4-bit scale; x = d (1/2 + s) / 2 * grid * sign."""
    aux = _u32(b[:, 66:98])
    db = f16(b, 0) * (0.5 + (aux >> 28).to(torch.float32)) * 0.5
    signs = 256 + ((aux[..., None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127)
    return _signed(Q.IQ3_XXS, db, b[:, 2:66], signs)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    """IQ3_S (110 B / 256): d f16, grid index low bytes[64], their ninth bits (qh[8]), sign bytes[32], a 4-bit
    scale per 32; x = d (1 + 2 s) * grid * sign."""
    high = split_bits(b[:, 66:74], 1, 8).transpose(1, 2).reshape(-1, 64).to(torch.int32)
    db = f16(b, 0) * (1 + 2 * _nibbles(b[:, 106:110])).to(torch.float32)
    return _signed(Q.IQ3_S, db, b[:, 2:66].to(torch.int32) | (high << 8), b[:, 74:106])


def _shifted(qtype: Q, dl: torch.Tensor, index: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """dl * (grid[index] + delta), delta -1/8 where negative else +1/8: dl (n, k) per 256 / k values, negative
    (n, k') per 256 / k' values."""
    n = dl.shape[0]
    delta = torch.where(negative.bool(), -0.125, 0.125).to(torch.float32).reshape(n, dl.shape[1], -1, 1)
    g = grid(qtype, dl.device)[index.long()].reshape(n, dl.shape[1], delta.shape[2], -1)
    return (dl[..., None, None] * (g + delta)).reshape(n, 256)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    """IQ1_S (50 B / 256): d f16, grid index low bytes[32], per 32 values a 16-bit field: 4 3-bit high index
    bits, a 3-bit scale, the delta's sign (top); x = d (2 s + 1) (grid + delta)."""
    qh = _u16(b[:, 34:50])
    dl = f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    high = (qh[..., None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    return _shifted(Q.IQ1_S, dl, b[:, 2:34].to(torch.int32) | (high.reshape(-1, 32) << 8), qh >> 15)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    """IQ1_M (56 B / 256): grid index low bytes[32], a nibble a group of 8 (3 high index bits, the delta's sign),
    4 16-bit fields of 3-bit scales (one per 16 values) whose top nibbles make d (f16)."""
    sc = _u16(b[:, 48:56])
    top = sc >> 12
    bits = torch.stack([top[:, 0] | (top[:, 1] << 4), top[:, 2] | (top[:, 3] << 4)], dim=1)
    d = bits.to(torch.uint8).view(torch.float16)
    scales = (sc[..., None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    dl = d.to(torch.float32) * (2 * scales.reshape(-1, 16) + 1).to(torch.float32)
    qh = _nibbles(b[:, 32:48]).to(torch.int32)
    return _shifted(Q.IQ1_M, dl, b[:, :32].to(torch.int32) | ((qh & 7) << 8), qh >> 3)


# Each type's torch reference (its entry in registry.py names this module); kernel_table is their tables' maker
REFERENCES = {
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
}
