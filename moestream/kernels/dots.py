"""The block dots of the decode matvec (kernels/matvec.py), one per tensor type that has one: each unpacks a
tile of stored blocks in registers and multiplies it by x's matching slices. formats/quants names each type's
dot; the tables below look the names up, so a new type's dot is a function here and a name there.

A dot takes base [R, B, 1] pointing at B consecutive blocks of each of R rows, xb [1, B, 1] at the blocks'
slices of x, ok [R, 1, 1] masking rows, and returns [R, B, W] partial products (summed by the caller). The
dots load the packed bytes as contiguous runs (K-quants as 32- or 16-bit words) and each scale once per row.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from moestream.formats import quants
from moestream.kernels.launch import triton

Q = GGMLQuantizationType

# A float weight (the router, a shared-expert gate) is read in blocks of FLOAT_BLOCK values
FLOAT_BLOCK = 32
FLOAT_QTYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
# The dots' word loads: their blocks must start this aligned
WORD_BYTES = {Q.Q4_K: 4, Q.Q5_K: 4, Q.Q6_K: 2} | {
    q: 2 for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
}

if triton is not None:
    import triton.language as tl

    from moestream.kernels.dequant import (
        f16_at,
        grid_word,
        iq1_m_fields,
        iq1_s_fields,
        iq2_s_fields,
        iq2_xs_fields,
        iq2_xxs_fields,
        iq3_s_fields,
        iq3_xxs_fields,
    )

    _FLOAT_BLOCK = tl.constexpr(FLOAT_BLOCK)

    @triton.jit
    def _exact_f32(v):
        """float32 of an int32 v with |v| < 2**22, exactly and without I2F, which an SM runs at 16 a clock (an
        eighth of FFMA's rate; the K-quant dots converted each element): the float whose bits are those of
        1.5 * 2**23 plus v is 1.5 * 2**23 + v, and one FADD takes the offset off."""
        return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _q4_k_scale_min(w1, w2, w3, k):
        """The 6-bit scale and min of sub-block k (of 8) from the block's scale words w1..w3, as float32."""
        sh = 8 * (k % 4)
        lo = k < 4
        sc = tl.where(lo, (w1 >> sh) & 63, ((w3 >> sh) & 15) | (((w1 >> (sh + 6)) & 3) << 4))
        mn = tl.where(lo, (w2 >> sh) & 63, ((w3 >> (sh + 4)) & 15) | (((w2 >> (sh + 6)) & 3) << 4))
        return _exact_f32(sc), _exact_f32(mn)

    @triton.jit
    def _bf16_of(v, b: tl.constexpr):
        """bfloat16 number b (little-endian) of those packed in the int64 (4) or int32 (2) v, as float32: a
        bfloat16's bits are the top half of its float32's."""
        half = (v >> 32).to(tl.int32) if b >= 2 else v.to(tl.int32)
        if b % 2 == 0:
            bits = half << 16
        else:
            bits = half & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _bits_to(v, s: tl.constexpr, p: tl.constexpr, mask: tl.constexpr):
        """Bits s.. of v moved to bit p, masked (a shift by a constant and an AND)."""
        if s <= p:
            r = (v << (p - s)) & mask
        else:
            r = (v >> (s - p)) & mask
        return r

    @triton.jit
    def q4_k_dot(base, xb, ok):
        """A Q4_K block (144 bytes) read as 36 int32 words: 5 loads a row instead of ~156 byte loads. Needs
        4-byte aligned blocks."""
        return _k_dot(base, xb, ok, False)

    @triton.jit
    def q5_k_dot(base, xb, ok):
        """A Q5_K block (176 bytes): Q4_K's words with the 32 qh bytes between scales and nibbles; bit s of
        qh byte l is the fifth bit of element 32 s + l. Needs 4-byte aligned blocks."""
        return _k_dot(base, xb, ok, True)

    @triton.jit
    def _k_dot(base, xb, ok, FIFTH: tl.constexpr):
        """Q4_K (FIFTH False) or Q5_K: the same scales and nibble order, Q5_K's nibbles 32 bytes later.

        A value n of 4 (5) bits becomes the float 1 + n / 16 (1 + n / 32) by moving its bits under the
        exponent of 1.0 (a shift, an AND and an OR), then one FMA: summing (1 + n / 16) x gives
        X + (n . x) / 16, X the sum of x over the same values, so d sc (n . x) - dmin m X =
        16 d sc A - (16 d sc + dmin m) X. The tile is [R, B, chunk, word], so a chunk's scales are one
        [R, B, 4, 1] tensor and X one [1, B, 4, 8]."""
        base, xb, ok = base[:, :, :, None], xb[:, :, :, None], ok[:, :, :, None]
        wp = base.to(tl.pointer_type(tl.int32))
        w0 = tl.load(wp, mask=ok, other=0)
        w1 = tl.load(wp + 1, mask=ok, other=0)
        w2 = tl.load(wp + 2, mask=ok, other=0)
        w3 = tl.load(wp + 3, mask=ok, other=0)
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        j = tl.arange(0, 4)[None, None, :, None]  # chunk of 32 bytes: sub-blocks 2 j (low), 2 j + 1 (high)
        w = tl.arange(0, 8)[None, None, None, :]  # word of the chunk: bytes 4 w + b
        q = tl.load(wp + (12 if FIFTH else 4) + 8 * j + w, mask=ok, other=0)  # [R, B, 4, 8]
        if FIFTH:  # qh word w holds qh bytes 4 w + b: the fifth bits of the same l as the nibbles' bytes
            qh = tl.load(wp + 4 + w, mask=ok, other=0) >> (2 * j)  # bit 8 b / 8 b + 1: low / high
        at = 64 * j + 4 * w  # element of byte 0's low nibble; high nibbles sit 32 further
        one = 0x3F800000  # the bits of 1.0
        PACKED: tl.constexpr = xb.dtype.element_ty == tl.bfloat16
        if PACKED:  # the 4 values of x beside a word's bytes as one 8-byte load (x 16-byte aligned: see _x)
            x4_lo = tl.load((xb + at).to(tl.pointer_type(tl.int64)))
            x4_hi = tl.load((xb + at + 32).to(tl.pointer_type(tl.int64)))
        for b in tl.static_range(4):
            if PACKED:
                xl = _bf16_of(x4_lo, b)
                xh = _bf16_of(x4_hi, b)
            else:
                xl = tl.load(xb + at + b).to(tl.float32)
                xh = tl.load(xb + at + 32 + b).to(tl.float32)
            if FIFTH:
                f_lo = _bits_to(q, 8 * b, 18, 0x3C0000) | _bits_to(qh, 8 * b, 22, 0x400000) | one
                f_hi = _bits_to(q, 8 * b + 4, 18, 0x3C0000) | _bits_to(qh, 8 * b + 1, 22, 0x400000) | one
            else:
                f_lo = _bits_to(q, 8 * b, 19, 0x780000) | one
                f_hi = _bits_to(q, 8 * b + 4, 19, 0x780000) | one
            if b == 0:
                a_lo = f_lo.to(tl.float32, bitcast=True) * xl
                a_hi = f_hi.to(tl.float32, bitcast=True) * xh
                x_lo = xl
                x_hi = xh
            else:
                a_lo += f_lo.to(tl.float32, bitcast=True) * xl
                a_hi += f_hi.to(tl.float32, bitcast=True) * xh
                x_lo += xl
                x_hi += xh
        sc0, m0 = _q4_k_scale_min(w1, w2, w3, 2 * j)
        sc1, m1 = _q4_k_scale_min(w1, w2, w3, 2 * j + 1)
        unit = 32.0 if FIFTH else 16.0
        c0, c1 = (unit * d) * sc0, (unit * d) * sc1
        return c0 * a_lo + c1 * a_hi - (c0 + dmin * m0) * x_lo - (c1 + dmin * m1) * x_hi

    @triton.jit
    def q6_k_dot(base, xb, ok):
        """A Q6_K block (210 bytes, 2-byte aligned) read as 16-bit words: per half of 128 elements, lane w
        loads ql words w and 16 + w and qh word w once, 8 elements of each (bytes 2 w and 2 w + 1, the four
        quarters j of 32 elements); each 6-bit value times its int8 scale is one integer product, and d
        multiplies once a block."""
        d = f16_at(base, 208, ok)
        lane = tl.arange(0, 16)[None, None, :]
        wp = base.to(tl.pointer_type(tl.int16))
        acc = tl.zeros_like(d) * lane  # [R, B, 16]
        for h in tl.static_range(2):
            ql_a = tl.load(wp + 32 * h + lane, mask=ok, other=0).to(tl.int32) & 0xFFFF
            ql_b = tl.load(wp + 32 * h + 16 + lane, mask=ok, other=0).to(tl.int32) & 0xFFFF
            qh = tl.load(wp + 64 + 16 * h + lane, mask=ok, other=0).to(tl.int32) & 0xFFFF
            for j in tl.static_range(4):
                ql = ql_a if j % 2 == 0 else ql_b
                low = (ql & 0x0F0F) if j < 2 else ((ql >> 4) & 0x0F0F)  # both bytes' nibbles at once
                q = low | (((qh >> (2 * j)) & 0x0303) << 4)
                sw = tl.load(wp + 96 + 4 * h + j, mask=ok, other=0).to(tl.int32)  # scales 2 j, 2 j + 1 of half h
                sc = tl.where(lane < 8, (sw << 24) >> 24, (sw << 16) >> 24)  # lanes 0-7: elements 0-15
                xe = xb + 128 * h + 32 * j + 2 * lane
                if xb.dtype.element_ty == tl.bfloat16:  # both values as one 4-byte load (see _k_dot)
                    x2 = tl.load(xe.to(tl.pointer_type(tl.int32)))
                    x0, x1 = _bf16_of(x2, 0), _bf16_of(x2, 1)
                else:
                    x0 = tl.load(xe).to(tl.float32)
                    x1 = tl.load(xe + 1).to(tl.float32)
                acc += _exact_f32(((q & 0xFF) - 32) * sc) * x0
                acc += _exact_f32(((q >> 8) - 32) * sc) * x1
        return d * acc

    @triton.jit
    def q8_0_dot(base, xb, ok):
        lane = tl.arange(0, 32)[None, None, :]
        q = tl.load(base + 2 + lane, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (q * f16_at(base, 0, ok)) * tl.load(xb + lane).to(tl.float32)

    @triton.jit
    def _x_pair(xb, at):
        """x's values at at and at + 1 (at even) as float32; a bfloat16 pair as one 4-byte load."""
        if xb.dtype.element_ty == tl.bfloat16:
            x2 = tl.load((xb + at).to(tl.pointer_type(tl.int32)))
            lo, hi = _bf16_of(x2, 0), _bf16_of(x2, 1)
        else:
            lo = tl.load(xb + at).to(tl.float32)
            hi = tl.load(xb + at + 1).to(tl.float32)
        return lo, hi

    @triton.jit
    def _grid_dot(base, xb, ok, table, FIELDS: tl.constexpr, SHIFTED: tl.constexpr):
        """An IQ grid block (kernels/dequant.py's _fields) as [R, B, 32 groups of 8, 4 words]: each lane loads
        its grid word and sign word from the L1-resident table (a group's 4 words are 16 contiguous bytes),
        XORs the signs into the two bfloat16 halves, and takes each half apart with one shift or AND. IQ1's
        shift adds delta times the sum of x over the word."""
        base, xb, ok = base[:, :, :, None], xb[:, :, :, None], ok[:, :, :, None]
        G = tl.arange(0, 32)[None, None, :, None]
        j = tl.arange(0, 4)[None, None, None, :]
        xl, xh = _x_pair(xb, 8 * G + 2 * j)
        if SHIFTED:
            scale, delta, gw = FIELDS(base, G, j, ok, True)
            w = grid_word(table, gw, gw, False)
        else:
            scale, gw, sw = FIELDS(base, G, j, ok, True)
            w = grid_word(table, gw, sw, True)
        acc = (w << 16).to(tl.float32, bitcast=True) * xl + (w & -65536).to(tl.float32, bitcast=True) * xh
        if SHIFTED:
            acc += delta * (xl + xh)
        return scale * acc

    @triton.jit
    def iq2_xxs_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq2_xxs_fields, False)

    @triton.jit
    def iq2_xs_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq2_xs_fields, False)

    @triton.jit
    def iq2_s_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq2_s_fields, False)

    @triton.jit
    def iq3_xxs_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq3_xxs_fields, False)

    @triton.jit
    def iq3_s_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq3_s_fields, False)

    @triton.jit
    def iq1_s_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq1_s_fields, True)

    @triton.jit
    def iq1_m_dot(base, xb, ok, table):
        return _grid_dot(base, xb, ok, table, iq1_m_fields, True)

    @triton.jit
    def block_dot(DOT: tl.constexpr, base, xb, ok, table, TABLE: tl.constexpr):
        """DOT's partial products; a type with a lookup table (TABLE) gets it as a fourth argument."""
        if TABLE:
            r = DOT(base, xb, ok, table)
        else:
            r = DOT(base, xb, ok)
        return r

    @triton.jit
    def _float_dot(base, xb, ok, TY: tl.constexpr):
        """FLOAT_BLOCK plain values of type TY (a float weight: the router, a shared-expert gate)."""
        lane = tl.arange(0, _FLOAT_BLOCK)[None, None, :]
        return tl.load(base.to(tl.pointer_type(TY)) + lane, mask=ok, other=0).to(tl.float32) * tl.load(xb + lane).to(
            tl.float32
        )

    @triton.jit
    def f32_dot(base, xb, ok):
        return _float_dot(base, xb, ok, tl.float32)

    @triton.jit
    def f16_dot(base, xb, ok):
        return _float_dot(base, xb, ok, tl.float16)

    @triton.jit
    def bf16_dot(base, xb, ok):
        return _float_dot(base, xb, ok, tl.bfloat16)

    _NAMED = {t.qtype: globals()[t.dot] for t in quants.TYPES.values() if t.dot}  # by the names formats gives
    DOTS = {q: dot for q, dot in _NAMED.items() if q not in FLOAT_QTYPES.values()}
    FLOAT_DOTS = {q: dot for q, dot in _NAMED.items() if q in FLOAT_QTYPES.values()}
else:
    DOTS, FLOAT_DOTS = {}, {}
