"""Nearest-grid quantizers for the IQ grid types (formats/quants/grids.py), for the project's model generator.

llama.cpp searches scales against an importance matrix; random weights need none, so each scale group here
takes the scale that maps its largest magnitude onto the grid's largest value, and each group of values the
grid row nearest to it (one matrix product and an argmin over the grid). Values already on a grid, whose scale
groups each reach the largest grid value, come back unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.grids import grid_values

_F16_MAX = np.float32(np.finfo(np.float16).max)

# Rows of values per nearest-grid step (temporaries stay in cache: measured fastest), and the grid rows tried
_SEARCH_ROWS = 4096
_NEIGHBOURS = 8


@dataclass(frozen=True)
class Fields:
    """One chunk of blocks as their fields: d [n] (fp16), scales [n, k] (4- or 3-bit), grid row indices
    [n, 256 / width], and either sign bytes [n, 32] (bit j set: element j of the 8 negative) or, for IQ1,
    negative deltas [n, m] as 0/1."""

    d: np.ndarray
    scales: np.ndarray
    index: np.ndarray
    signs: np.ndarray


@dataclass(frozen=True)
class _Spec:
    width: int  # values per grid row
    per_scale: int  # values sharing a scale
    scale_max: int
    multiplier: Callable[[np.ndarray], np.ndarray]  # scale field -> the factor of d it stands for
    parity: bool  # sign patterns must hold an even count of minus signs (7-bit sign indices)
    pack: Callable[[Fields, np.ndarray], None]


def _u16(v: np.ndarray) -> np.ndarray:
    """Integer fields -> their little-endian 16-bit bytes, two per field."""
    return v.astype("<u2").view(np.uint8).reshape(len(v), -1)


def _u32(v: np.ndarray) -> np.ndarray:
    return v.astype("<u4").view(np.uint8).reshape(len(v), -1)


def _nibble_pairs(v: np.ndarray) -> np.ndarray:
    """[n, 2m] 4-bit fields -> [n, m] bytes, the even field in the low nibble."""
    return (v[:, 0::2] | (v[:, 1::2] << 4)).astype(np.uint8)


def _d16(d: np.ndarray) -> np.ndarray:
    return _u16(d.astype(np.float16).view(np.uint16)[:, None])


def _sign_words(f: Fields, scales: np.ndarray) -> np.ndarray:
    """4 7-bit sign indices (an even-parity byte's low 7 bits) and a 4-bit scale a 32-bit word, per 32 values."""
    idx = (f.signs & 127).astype(np.uint32).reshape(len(f.signs), -1, 4)
    return idx[..., 0] | (idx[..., 1] << 7) | (idx[..., 2] << 14) | (idx[..., 3] << 21) | (scales << 28)


def _pack_iq2_xxs(f: Fields, out: np.ndarray) -> None:
    n = len(out)
    out[:, 0:2] = _d16(f.d)
    body = out[:, 2:66].reshape(n, 8, 8)
    body[..., :4] = f.index.reshape(n, 8, 4)
    body[..., 4:] = _u32(_sign_words(f, f.scales.astype(np.uint32))).reshape(n, 8, 4)


def _pack_iq2_xs(f: Fields, out: np.ndarray) -> None:
    out[:, 0:2] = _d16(f.d)
    out[:, 2:66] = _u16(f.index | ((f.signs.astype(np.uint16) & 127) << 9))
    out[:, 66:74] = _nibble_pairs(f.scales)


def _pack_iq2_s(f: Fields, out: np.ndarray) -> None:
    high = (f.index >> 8).reshape(len(out), 8, 4)
    out[:, 0:2] = _d16(f.d)
    out[:, 2:34] = f.index & 255
    out[:, 34:66] = f.signs
    out[:, 66:74] = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
    out[:, 74:82] = _nibble_pairs(f.scales)


def _pack_iq3_xxs(f: Fields, out: np.ndarray) -> None:
    out[:, 0:2] = _d16(f.d)
    out[:, 2:66] = f.index
    out[:, 66:98] = _u32(_sign_words(f, f.scales.astype(np.uint32)))


def _pack_iq3_s(f: Fields, out: np.ndarray) -> None:
    out[:, 0:2] = _d16(f.d)
    out[:, 2:66] = f.index & 255
    out[:, 66:74] = np.packbits((f.index >> 8).astype(np.uint8).reshape(len(out), 8, 8), axis=-1, bitorder="little")[
        ..., 0
    ]
    out[:, 74:106] = f.signs
    out[:, 106:110] = _nibble_pairs(f.scales)


def _pack_iq1_s(f: Fields, out: np.ndarray) -> None:
    high = (f.index >> 8).astype(np.uint16).reshape(len(out), 8, 4)
    qh = high[..., 0] | (high[..., 1] << 3) | (high[..., 2] << 6) | (high[..., 3] << 9)
    out[:, 0:2] = _d16(f.d)
    out[:, 2:34] = f.index & 255
    out[:, 34:50] = _u16(qh | (f.scales.astype(np.uint16) << 12) | (f.signs.astype(np.uint16) << 15))


def _pack_iq1_m(f: Fields, out: np.ndarray) -> None:
    d = f.d.astype(np.float16).view(np.uint16)
    sc = f.scales.astype(np.uint16).reshape(len(out), 4, 4)
    top = (d[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 15  # d's nibbles, lowest first
    out[:, 0:32] = f.index & 255
    out[:, 32:48] = _nibble_pairs(((f.index >> 8) | (f.signs << 3)).astype(np.uint8))
    out[:, 48:56] = _u16(sc[..., 0] | (sc[..., 1] << 3) | (sc[..., 2] << 6) | (sc[..., 3] << 9) | (top << 12))


def _quarter(s: np.ndarray) -> np.ndarray:
    return (np.float32(0.5) + s) * np.float32(0.25)


def _half(s: np.ndarray) -> np.ndarray:
    return (np.float32(0.5) + s) * np.float32(0.5)


def _odd(s: np.ndarray) -> np.ndarray:
    return (2 * s + 1).astype(np.float32)


SPECS: dict[Q, _Spec] = {
    Q.IQ2_XXS: _Spec(8, 32, 15, _quarter, True, _pack_iq2_xxs),
    Q.IQ2_XS: _Spec(8, 16, 15, _quarter, True, _pack_iq2_xs),
    Q.IQ2_S: _Spec(8, 16, 15, _quarter, False, _pack_iq2_s),
    Q.IQ3_XXS: _Spec(4, 32, 15, _half, True, _pack_iq3_xxs),
    Q.IQ3_S: _Spec(4, 32, 15, _odd, False, _pack_iq3_s),
    Q.IQ1_S: _Spec(8, 32, 7, _odd, False, _pack_iq1_s),
    Q.IQ1_M: _Spec(8, 16, 7, _odd, False, _pack_iq1_m),
}
_DELTA_GROUP = {Q.IQ1_S: 32, Q.IQ1_M: 8}  # values sharing IQ1's +-1/8 shift
_DELTA = np.float32(0.125)
_ODD_PARITY = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1) % 2 == 1  # per sign byte


def pack(qtype: Q, fields: Fields) -> np.ndarray:
    """The blocks [n, type_size] holding fields (the quantizer's last step; tests write edge patterns with it)."""
    out = np.zeros((len(fields.d), GGML_QUANT_SIZES[qtype][1]), np.uint8)
    SPECS[qtype].pack(fields, out)
    return out


def quantize_blocks(qtype: Q, x: np.ndarray, out: np.ndarray) -> None:
    """Encode x [n, 256] float32 into out [n, type_size]."""
    SPECS[qtype].pack(fields_of(qtype, x), out)


def fields_of(qtype: Q, x: np.ndarray) -> Fields:
    """The fields of blocks approximating x [n, 256]: scales from each group's largest magnitude, then the
    nearest grid rows (and, for IQ1, the better delta)."""
    spec, n = SPECS[qtype], len(x)
    if qtype in _DELTA_GROUP:
        return _shifted_fields(qtype, spec, x)
    a = np.abs(x)
    d, scales, step = _scales(spec, a.reshape(n, -1, spec.per_scale).max(axis=-1) / grid_values(qtype).max())
    signs = np.packbits((x < 0).reshape(n, 32, 8), axis=-1, bitorder="little").reshape(n, 32)
    target = a.reshape(n, 32, 8)
    if spec.parity:  # an odd count of minus signs: the smallest magnitude takes the wrong sign, aiming at 0
        odd = np.flatnonzero(_ODD_PARITY[signs])
        low = target.reshape(-1, 8)[odd].argmin(axis=-1)
        signs.reshape(-1)[odd] ^= (1 << low).astype(np.uint8)
        target.reshape(-1, 8)[odd, low] = 0
    y = target.reshape(n, -1, spec.per_scale) * _inv(step)[..., None]
    index = _nearest(qtype, y.reshape(-1, spec.width))[0]
    return Fields(d, scales, index.reshape(n, -1), signs)


def _shifted_fields(qtype: Q, spec: _Spec, x: np.ndarray) -> Fields:
    """IQ1: values dl (grid + delta), delta +-1/8 per _DELTA_GROUP values, the grid's values -1, 0 and 1."""
    n = len(x)
    top = np.float32(1) + _DELTA
    d, scales, step = _scales(spec, np.abs(x).reshape(n, -1, spec.per_scale).max(axis=-1) / top)
    y = (x.reshape(n, -1, spec.per_scale) * _inv(step)[..., None]).reshape(-1, 8)
    (up, err_up), (down, err_down) = _nearest(qtype, y - _DELTA), _nearest(qtype, y + _DELTA)
    rows = _DELTA_GROUP[qtype] // 8
    negative = err_down.reshape(-1, rows).sum(axis=-1) < err_up.reshape(-1, rows).sum(axis=-1)
    index = np.where(negative.repeat(rows), down, up)
    return Fields(d, scales, index.reshape(n, -1), negative.reshape(n, -1).astype(np.uint8))


def _scales(spec: _Spec, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block an fp16 d and per scale group the field whose multiplier times d comes nearest want [n, k]:
    d (float32, fp16 values), the fields [n, k] and the steps d * multiplier [n, k]."""
    multipliers = spec.multiplier(np.arange(spec.scale_max + 1, dtype=np.float32))
    d = np.minimum(want.max(axis=-1) / multipliers[-1], _F16_MAX).astype(np.float16).astype(np.float32)
    ratio = want * _inv(d)[:, None]
    scales = np.abs(ratio[..., None] - multipliers).argmin(axis=-1).astype(np.uint8)
    return d, scales, d[:, None] * multipliers[scales]


def _nearest(qtype: Q, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The grid row nearest each row of y [N, width], and its squared distance: of the _NEIGHBOURS rows nearest
    the lattice point (each value rounded to the nearest grid level) that y rounds to, the first of least
    distance. A distance sums its squares as ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) (width 4: (s0 +
    s1) + (s2 + s3)): the order of numpy's einsum on 4-wide SIMD, the search this replaces, whose bytes it keeps;
    spelt out, the order no longer depends on the machine."""
    lattice = _lattice(Q.IQ1_S if qtype == Q.IQ1_M else qtype)  # IQ1_M's grid is IQ1_S's
    index, error = np.empty(len(y), np.int64), np.empty(len(y), np.float32)
    rows = np.arange(_SEARCH_ROWS)
    for start in range(0, len(y), _SEARCH_ROWS):
        part = y[start : start + _SEARCH_ROWS]
        point = lattice.point(part)
        squares = []  # per coordinate, [n, _NEIGHBOURS]: coordinate-major, each step a contiguous pass
        for w, values in enumerate(lattice.values):
            diff = np.take(values, point, axis=0)
            diff -= part[:, w : w + 1]
            squares.append(np.square(diff, out=diff))
        for w in range(len(squares) - 4):  # width 8: lane w takes w + 4
            squares[w] += squares[w + 4]
        distance = squares[0] + squares[1]
        distance += squares[2] + squares[3]
        best, at = distance.argmin(axis=-1), rows[: len(part)]
        index[start : start + len(part)] = lattice.neighbours[point, best]
        error[start : start + len(part)] = distance[at, best]
    return index, error


@dataclass(frozen=True)
class _Lattice:
    """A grid's search table: the points whose coordinates are each one of the grid's levels, each with the
    _NEIGHBOURS grid rows nearest it, a point numbered by its levels' indices as digits (coordinate k the k-th
    digit, base len(levels))."""

    midpoints: np.ndarray  # halfway between neighbouring levels (the levels sorted)
    place: np.ndarray  # each digit's place value, float32 (a point's number is a small integer)
    neighbours: np.ndarray  # [points, _NEIGHBOURS] grid row indices
    values: np.ndarray  # [width, points, _NEIGHBOURS]: coordinate w of each point's neighbours

    def point(self, y: np.ndarray) -> np.ndarray:
        """The number of the lattice point each row of y [n, width] rounds to (a tie to the lower level)."""
        digits = (y > self.midpoints[0]).astype(np.float32)
        for m in self.midpoints[1:]:
            digits += y > m
        return (digits @ self.place).astype(np.intp)


@functools.cache
def _lattice(qtype: Q) -> _Lattice:
    """The grid's search table, built once."""
    grid = grid_values(qtype)
    levels = np.unique(grid)
    digits = np.indices((len(levels),) * grid.shape[1]).reshape(grid.shape[1], -1)[::-1].T
    points = levels[digits]
    distance = (points * points).sum(axis=-1)[:, None] - 2 * points @ grid.T + (grid * grid).sum(axis=-1)
    neighbours = np.argpartition(distance, _NEIGHBOURS, axis=-1)[:, :_NEIGHBOURS]
    place = (len(levels) ** np.arange(grid.shape[1])).astype(np.float32)
    values = np.ascontiguousarray(grid[neighbours].transpose(2, 0, 1))
    return _Lattice((levels[1:] + levels[:-1]) / 2, place, neighbours, values)


def _inv(v: np.ndarray) -> np.ndarray:
    """1 / v, with 0 where v is 0 (an all-zero group encodes as zeros)."""
    return np.divide(np.float32(1), v, out=np.zeros_like(v), where=v != 0)
