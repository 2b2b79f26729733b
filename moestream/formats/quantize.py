"""Quantize float32 arrays into GGUF block types, for the project's model generator.

gguf 0.19 quantizes the 32-element types but none of the K-quants, so those are encoded here with simple
scales (per-sub-block min/max for Q2_K/Q4_K/Q5_K, signed absmax for Q3_K/Q6_K) rather than llama.cpp's
searched ones: any valid encoding serves test models, and the generator writes gigabytes, so speed wins.
MXFP4 gives gguf's own bytes, computed here because gguf's quantizer is an order of magnitude slower. IQ4_NL
and IQ4_XS (gguf has no quantizer for them) take each value's nearest code under a scale that puts the
block's largest magnitude on the code -127.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError
from moestream.formats import grid_quantize
from moestream.formats.quants import row_bytes
from moestream.formats.quants.nonlinear import IQ4_VALUES

Q = GGMLQuantizationType

_BY_GGUF = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0})

# Floats encoded per step (4 MiB): of 64K to 4M, 1M was as fast as any (the IQ4 and K-quants 5-15% faster
# than 4M), and temporaries stay a few MiB.
_CHUNK_ELEMENTS = 1 << 20

_F16_MAX = float(np.finfo(np.float16).max)


def _fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round (n, 1) non-negative scales to fp16: the stored bytes (n, 2) and the float32 that decoders see."""
    h = np.minimum(v, _F16_MAX).astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _inv(v: np.ndarray) -> np.ndarray:
    """1 / v, with 0 where v is 0 (an all-zero block encodes as zeros)."""
    return np.divide(np.float32(1), v, out=np.zeros_like(v), where=v != 0)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """(..., count, m) small uint8 fields -> (..., m) bytes, field i at bit bits*i (lowest first)."""
    out = q[..., 0, :].copy()
    for i in range(1, q.shape[-2]):
        out |= q[..., i, :] << np.uint8(bits * i)
    return out


def _extremes(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """xs.min(axis=-1) and xs.max(axis=-1), halving a last axis of a power of two: numpy reduces a short last axis
    several times slower than whole-array minimum / maximum, and these were the generator's largest cost."""
    lo = hi = xs
    while lo.shape[-1] > 1:
        h = lo.shape[-1] // 2
        lo, hi = np.minimum(lo[..., :h], lo[..., h:]), np.maximum(hi[..., :h], hi[..., h:])
    return lo[..., 0], hi[..., 0]


def _affine(x: np.ndarray, sub: int, qmax: int, scale_max: int):
    """x ~ d*sc*q - dmin*m per sub-block, from its min (clamped to <= 0) and max.

    Returns the fp16 bytes of d and dmin, the integer scales and mins (n, n_sub), and q (n, n_sub, sub).
    """
    xs = x.reshape(len(x), -1, sub)
    lo, hi = _extremes(xs)
    lo = np.minimum(lo, 0)
    scale = (hi - lo) / np.float32(qmax)
    d_bytes, d = _fp16(scale.max(axis=-1, keepdims=True) / np.float32(scale_max))
    dmin_bytes, dmin = _fp16(-lo.min(axis=-1, keepdims=True) / np.float32(scale_max))
    sc = np.clip(np.rint(scale * _inv(d)), 0, scale_max)
    mn = np.clip(np.rint(-lo * _inv(dmin)), 0, scale_max)
    t = (xs + (dmin * mn)[..., None]) * _inv(d * sc)[..., None]
    q = np.clip(np.rint(t, out=t), 0, qmax, out=t).astype(np.uint8)
    return d_bytes, dmin_bytes, sc.astype(np.uint8), mn.astype(np.uint8), q


def _symmetric(x: np.ndarray, sub: int, qmin: int, qmax: int, scale_max: int):
    """x ~ d*sc*q per sub-block, the sub-block's largest-magnitude value landing on qmin (-4 or -32).

    Returns the fp16 bytes of d, the signed scales (n, n_sub) and q + |qmin| as uint8 (n, n_sub, sub).
    """
    xs = x.reshape(len(x), -1, sub)
    lo, hi = _extremes(xs)
    scale = np.where(hi >= -lo, hi, lo) / np.float32(qmin)
    d_bytes, d = _fp16(np.abs(scale).max(axis=-1, keepdims=True) / np.float32(scale_max))
    sc = np.clip(np.rint(scale * _inv(d)), -scale_max, scale_max)
    t = xs * _inv(d * sc)[..., None]
    q = np.clip(np.rint(t, out=t), qmin, qmax, out=t) - np.float32(qmin)
    return d_bytes, sc.astype(np.int8), q.astype(np.uint8)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> the 12-byte field of Q4_K/Q5_K."""
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _q2_k(x: np.ndarray, out: np.ndarray) -> None:
    """Q2_K (84 B / 256): scales[16] (scale | min << 4), qs[64] 2-bit, d f16, dmin f16."""
    n = len(x)
    d, dmin, sc, mn, q = _affine(x, 16, 3, 15)
    out[:, 0:16] = sc | (mn << 4)
    out[:, 16:80] = _pack_bits(q.reshape(n, 2, 4, 32), 2).reshape(n, 64)
    out[:, 80:82] = d
    out[:, 82:84] = dmin


def _q3_k(x: np.ndarray, out: np.ndarray) -> None:
    """Q3_K (110 B / 256): hmask[32] third bits, qs[64] 2-bit, scales[12] 6-bit signed, d f16."""
    n = len(x)
    d, sc, u = _symmetric(x, 16, -4, 3, 31)
    out[:, 0:32] = _pack_bits((u >> 2).reshape(n, 8, 32), 1)
    out[:, 32:96] = _pack_bits((u & 3).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    us = (sc + 32).view(np.uint8)
    out[:, 96:104] = (us[:, :8] & 0xF) | ((us[:, 8:] & 0xF) << 4)
    out[:, 104:108] = _pack_bits((us >> 4).reshape(n, 4, 4), 2)
    out[:, 108:110] = d


def _q4_k(x: np.ndarray, out: np.ndarray) -> None:
    """Q4_K (144 B / 256): d f16, dmin f16, scales[12] 6-bit, qs[128] nibbles."""
    n = len(x)
    d, dmin, sc, mn, q = _affine(x, 32, 15, 63)
    out[:, 0:2] = d
    out[:, 2:4] = dmin
    out[:, 4:16] = _k_scales(sc, mn)
    out[:, 16:144] = _pack_bits(q.reshape(n, 4, 2, 32), 4).reshape(n, 128)


def _q5_k(x: np.ndarray, out: np.ndarray) -> None:
    """Q5_K (176 B / 256): d f16, dmin f16, scales[12] 6-bit, qh[32] fifth bits, qs[128] nibbles."""
    n = len(x)
    d, dmin, sc, mn, q = _affine(x, 32, 31, 63)
    out[:, 0:2] = d
    out[:, 2:4] = dmin
    out[:, 4:16] = _k_scales(sc, mn)
    out[:, 16:48] = _pack_bits(q >> 4, 1)
    out[:, 48:176] = _pack_bits((q & 0xF).reshape(n, 4, 2, 32), 4).reshape(n, 128)


def _q6_k(x: np.ndarray, out: np.ndarray) -> None:
    """Q6_K (210 B / 256): ql[128] nibbles, qh[64] 2-bit, scales[16] int8, d f16."""
    n = len(x)
    d, sc, u = _symmetric(x, 16, -32, 31, 127)
    out[:, 0:128] = _pack_bits((u & 0xF).reshape(n, 2, 2, 64), 4).reshape(n, 128)
    out[:, 128:192] = _pack_bits((u >> 4).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d


# Halfway between neighbouring E2M1 magnitudes (doubled, as MXFP4 stores them): 0, 1, 2, 3, 4, 6, 8, 12
_E2M1_MIDPOINTS = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10], np.float32)


def _mxfp4(x: np.ndarray, out: np.ndarray) -> None:
    """MXFP4 (17 B / 32): gguf's bytes. The exponent puts the block's largest magnitude between 8 and 16 halved
    scales (12, the largest code, clamps the top quarter); each value takes the nearest code, a tie the smaller
    magnitude, and a value rounding to zero the positive one: what gguf's first-of-16-distances argmin picks,
    from seven comparisons instead."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    e32 = e.astype(np.uint32)
    half = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - 1) << np.uint32(23)).view(np.float32)
    a = np.abs(x) / half
    code = np.zeros(x.shape, np.uint8)
    for m in _E2M1_MIDPOINTS:
        code += a > m
    code |= ((x < 0) & (code > 0)).astype(np.uint8) << 3
    out[:, 0:1] = e
    out[:, 1:17] = code[:, :16] | (code[:, 16:] << 4)


# Halfway between neighbouring IQ4 values (nonlinear.IQ4_VALUES)
_IQ4_VALUES = np.array(IQ4_VALUES, np.float32)
_IQ4_MIDPOINTS = (_IQ4_VALUES[1:] + _IQ4_VALUES[:-1]) / 2


def _signed_fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_fp16 for scales of either sign."""
    h = np.clip(v, -_F16_MAX, _F16_MAX).astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _iq4_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest IQ4 value's code for each x / scale (scale broadcast over x; 0 for a zero scale): the count
    of midpoints below it, from 15 comparisons (np.searchsorted's count, 7x faster)."""
    t = x * _inv(scale)
    codes = (t > _IQ4_MIDPOINTS[0]).view(np.uint8)
    for m in _IQ4_MIDPOINTS[1:]:
        codes += t > m
    return codes


def _signed_absmax(xs: np.ndarray) -> np.ndarray:
    """Each row's value of largest magnitude, sign kept: (..., m) -> (...)."""
    lo, hi = _extremes(xs)
    return np.where(hi >= -lo, hi, lo)


def _iq4_nl(x: np.ndarray, out: np.ndarray) -> None:
    """IQ4_NL (18 B / 32): d f16, qs[16] nibbles (low: values 0..15)."""
    d_bytes, d = _signed_fp16(_signed_absmax(x)[:, None] / np.float32(-127))
    codes = _iq4_codes(x, d)
    out[:, 0:2] = d_bytes
    out[:, 2:18] = codes[:, :16] | (codes[:, 16:] << 4)


def _iq4_xs(x: np.ndarray, out: np.ndarray) -> None:
    """IQ4_XS (136 B / 256): d f16, scales_h u16, scales_l[4], qs[128]; a sub-block of 32's scale is a 6-bit
    multiple of d, less 32: the sub-block of largest scale takes -32 (as Q3_K's absmax scales)."""
    n = len(x)
    xs = x.reshape(n, 8, 32)
    scale = _signed_absmax(xs) / np.float32(-127)
    d_bytes, d = _signed_fp16(_signed_absmax(scale)[:, None] / np.float32(-32))
    sc = np.clip(np.rint(scale * _inv(d)), -32, 31)
    codes = _iq4_codes(xs, (d * sc)[..., None])
    u = (sc + 32).astype(np.uint16)
    out[:, 0:2] = d_bytes
    high = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)  # 2 bits a sub-block
    out[:, 2:4] = high.astype("<u2").view(np.uint8).reshape(n, 2)
    out[:, 4:8] = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    out[:, 8:136] = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).reshape(n, 128)


_OURS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray], None]] = {
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: _mxfp4,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
} | {qtype: partial(grid_quantize.quantize_blocks, qtype) for qtype in grid_quantize.SPECS}

QUANTIZABLE: frozenset[GGMLQuantizationType] = _BY_GGUF | frozenset(_OURS)


def quantize(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Encode a float32 array (last dim = row) as `qtype` blocks: uint8 of shape [..., row_bytes]."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype not in QUANTIZABLE:
        names = ", ".join(t.name for t in sorted(QUANTIZABLE))
        raise MoestreamError(f"cannot quantize to {qtype.name} (supported: {names})")
    out_shape = (*array.shape[:-1], row_bytes(qtype, array.shape[-1]))
    if qtype in _BY_GGUF:
        return np.ascontiguousarray(gguf.quants.quantize(array, qtype)).view(np.uint8).reshape(out_shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = array.reshape(-1, block)
    out = np.empty((len(blocks), type_size), np.uint8)
    step = _CHUNK_ELEMENTS // block
    for start in range(0, len(blocks), step):
        _OURS[qtype](blocks[start : start + step], out[start : start + step])
    return out.reshape(out_shape)
