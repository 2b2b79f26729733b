"""The block dots of the decode matvec (kernels/matvec.py), one per tensor type that has one: each unpacks a
tile of stored blocks in registers and multiplies it by x's matching slices. formats/quants names each type's
dot; the tables below look the names up, so a new type's dot is a function here and a name there.

A dot takes base [R, B, 1] pointing at B consecutive blocks of each of R rows, xb [1, B, 1] at the blocks'
slices of x, ok [R, 1, 1] masking rows (or [R, B, 1]: a row's last turn, partly past its end), and returns [R,
B, W] or [R, B, W, V] partial products (summed by the caller). The dots load the packed bytes as 32- or 16-bit
words (blocks off a word boundary, such as MXFP4's 17 bytes, through _word_at), a bfloat16 x 2 or 4 values a
load, and each scale once per row; small integers become floats without I2F (1 + q / 2**bits under the
exponent of 1.0, or 2**23 + q), and IQ4's table is looked up in registers (prmt).
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
# The dots' word loads: their blocks must start this aligned (_word_at reads words at any alignment)
WORD_BYTES = {Q.Q2_K: 4, Q.Q3_K: 2, Q.Q4_K: 4, Q.Q5_K: 4, Q.Q6_K: 2, Q.Q4_0: 2, Q.Q4_1: 4, Q.Q5_0: 2, Q.Q5_1: 4} | {
    q: 2 for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
}
WORD_BYTES |= {Q.IQ4_NL: 2, Q.IQ4_XS: 4, Q.TQ1_0: 2, Q.TQ2_0: 2}

if triton is not None:
    import triton.language as tl

    from moestream.kernels.dequant import (
        byte_value,
        e2m1_pair,
        e8m0_half,
        f16_at,
        f16_pair,
        grid_quad,
        iq1_m_fields,
        iq1_s_fields,
        iq2_s_fields,
        iq2_xs_fields,
        iq2_xxs_fields,
        iq3_s_fields,
        iq3_xxs_fields,
        iq4_bytes,
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
    def _iq4_sums(u, xb, lane):
        """The sum of value x over the 8 IQ4 codes of the word u of a 32-value block's nibble bytes 4 lane..
        (element 4 lane + k low, 16 + 4 lane + k high): each code's value from iq4_bytes, exact (byte_value)."""
        lo, hi = iq4_bytes(u)
        x_lo, x_hi = _x_quads(xb, lane)
        acc = tl.zeros(u.shape, tl.float32)
        for k in tl.static_range(4):
            acc += byte_value(lo, k, 128) * _x_at(xb, x_lo, 4 * lane, k)
            acc += byte_value(hi, k, 128) * _x_at(xb, x_hi, 16 + 4 * lane, k)
        return acc

    @triton.jit
    def iq4_nl_dot(base, xb, ok):
        """An IQ4_NL block (18 bytes, 2-byte aligned): d times _iq4_sums over its four words (_word_at)."""
        lane = tl.arange(0, 4)[None, None, :]
        return _f16_word(base, 0, ok) * _iq4_sums(_word_at(base + 2 + 4 * lane, ok), xb, lane)

    @triton.jit
    def iq4_xs_dot(base, xb, ok):
        """An IQ4_XS block (136 bytes, 4-byte aligned: word loads): lane 4 i + l takes word l of sub-block i's
        16 nibble bytes, scaled by d ((scales_l nibble i | scales_h bits 2 i << 4) - 32)."""
        lane = tl.arange(0, 32)[None, None, :]
        i = lane // 4
        wp = base.to(tl.pointer_type(tl.int32))
        w0 = tl.load(wp, mask=ok, other=0)  # d, then scales_h
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        lo = (tl.load(wp + 1, mask=ok, other=0) >> (4 * i)) & 15
        sc = _exact_f32((lo | (((w0 >> (16 + 2 * i)) & 3) << 4)) - 32)
        u = tl.load(wp + 2 + lane, mask=ok, other=0)
        return (d * sc) * _iq4_sums(u, xb + 32 * i, lane % 4)

    @triton.jit
    def tq2_0_dot(base, xb, ok):
        """A TQ2_0 block (66 bytes, 2-byte aligned: _words4_at), lanes as in q2_k_dot: (q - 1) . x = 4 A - 5 X
        with q as 1 + q / 4 (_low_k_sums), times d."""
        s = tl.arange(0, 16)[None, None, :]
        h, j, g = s // 8, s // 2 % 4, s % 2
        w0, w1, w2, w3 = _words4_at(base + 32 * h + 16 * g, ok)
        sh = 2 * j
        a, x = _low_k_sums(w0 >> sh, w1 >> sh, w2 >> sh, w3 >> sh, xb + 128 * h + 32 * j + 16 * g, 21, 0x600000)
        return _f16_word(base, 64, ok) * (4.0 * a - 5.0 * x)

    @triton.jit
    def tq1_0_dot(base, xb, ok):
        """A TQ1_0 block (54 bytes, 2-byte aligned): lane w < 12 takes qs word w (5 trits a byte), lane 12 the
        qh word (4 trits), lanes 13-15 nothing. Trit k of byte v is the top of (v 3**k mod 256) 3 / 256,
        worked out for two bytes at once in the 16-bit halves of a word; values 32 k + l (qs[l], l < 32),
        160 + 16 k + l (qs[32 + l]), 240 + 4 k + l (qh[l]); each (q - 1) exact (byte_value), times d."""
        w = tl.arange(0, 16)[None, None, :]
        ok_w = ok & (w < 13)
        u = _word_at(base + 4 * tl.minimum(w, 12), ok_w)
        at = tl.where(w < 8, 4 * w, tl.where(w < 12, 160 + 4 * (w - 8), 240))  # x of the word's trit 0
        step = tl.where(w < 8, 32, tl.where(w < 12, 16, 4))  # x between its trits
        even, odd = u & 0x00FF00FF, (u >> 8) & 0x00FF00FF  # bytes 0 and 2, 1 and 3
        acc = tl.zeros(u.shape, tl.float32)
        for k in tl.static_range(5):
            xp = xb + at + step * k
            used = (w < 12) if k == 4 else (w < 13)  # qh has 4 trits
            if xb.dtype.element_ty == tl.bfloat16:
                quad = tl.load(xp.to(tl.pointer_type(tl.int64)), mask=used, other=0)
            else:
                quad = tl.zeros(xp.shape, tl.int64)
            p = 3**k
            te = ((((even * p) & 0x00FF00FF) * 3) >> 8) & 0x00030003  # trits of bytes 0 (bits 0-1), 2 (16-17)
            to = ((((odd * p) & 0x00FF00FF) * 3) >> 8) & 0x00030003
            for b in tl.static_range(4):
                t = te if b % 2 == 0 else to
                v = byte_value(t, 2 * (b // 2), 1)  # the trit less 1
                if xb.dtype.element_ty == tl.bfloat16:
                    xv = _bf16_of(quad, b)
                else:
                    xv = tl.load(xp + b, mask=used, other=0).to(tl.float32)
                acc += v * xv
        return _f16_word(base, 52, ok) * acc

    @triton.jit
    def _words4_at(p, ok):
        """The 4 int32 words of the 16 bytes at p (2-byte aligned): 5 aligned loads, the last only when the
        bytes straddle them, each word cut from two (see _word_at)."""
        r = (p.to(tl.int64) & 3).to(tl.int32)
        wp = (p - r).to(tl.pointer_type(tl.int32))
        w0 = tl.load(wp, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        w1 = tl.load(wp + 1, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        w2 = tl.load(wp + 2, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        w3 = tl.load(wp + 3, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        w4 = tl.load(wp + 4, mask=ok & (r != 0), other=0).to(tl.int64)
        sh = 8 * r
        return (
            ((w0 | (w1 << 32)) >> sh).to(tl.int32),
            ((w1 | (w2 << 32)) >> sh).to(tl.int32),
            ((w2 | (w3 << 32)) >> sh).to(tl.int32),
            ((w3 | (w4 << 32)) >> sh).to(tl.int32),
        )

    @triton.jit
    def _low_k_sums(t0, t1, t2, t3, xp, SHIFT: tl.constexpr, MASK: tl.constexpr):
        """A = the sum of f x and X = the sum of x over a lane's 16 values: value 4 w + b is the field at bit
        8 b of word tw, moved under the exponent of 1.0 (bits SHIFT.., MASK) to make f = 1 + q / 2**bits; x's
        16 values at xp, 4 to a load when bfloat16."""
        one = 0x3F800000
        for w in tl.static_range(4):
            t = t0 if w == 0 else (t1 if w == 1 else (t2 if w == 2 else t3))
            quad = _quad(xp + 4 * w)
            for b in tl.static_range(4):
                xv = _x4(xp + 4 * w, b, quad)
                f = (_bits_to(t, 8 * b, SHIFT, MASK) | one).to(tl.float32, bitcast=True)
                if w + b == 0:
                    a = f * xv
                    x = xv
                else:
                    a += f * xv
                    x += xv
        return a, x

    @triton.jit
    def _x4(xp, b: tl.constexpr, quad):
        """x's value b of the 4 at xp: from quad (their packed bfloat16s) or loaded (a float32 x)."""
        if xp.dtype.element_ty == tl.bfloat16:
            v = _bf16_of(quad, b)
        else:
            v = tl.load(xp + b).to(tl.float32)
        return v

    @triton.jit
    def _quad(xp):
        """The 4 bfloat16 values at xp (8-byte aligned) as one 8-byte load (zeros, unread, for a float32 x)."""
        if xp.dtype.element_ty == tl.bfloat16:
            q = tl.load(xp.to(tl.pointer_type(tl.int64)))
        else:
            q = tl.zeros(xp.shape, tl.int64)
        return q

    @triton.jit
    def q2_k_dot(base, xb, ok):
        """A Q2_K block (84 bytes, 4-byte aligned: word loads). Lane s takes sub-block s of 16 values: bytes
        l = 16 g.. (g = s % 2) of the 32-byte half h = s // 8 of the fields, field j = s // 2 % 4 of each
        (values 128 h + 32 j + l), so each lane reads its scale byte once. As 1 + q / 4 (_k_dot's trick):
        d sc q . x - dmin m X = 4 d sc A - (4 d sc + dmin m) X."""
        s = tl.arange(0, 16)[None, None, :]
        h, j, g = s // 8, s // 2 % 4, s % 2
        wp = base.to(tl.pointer_type(tl.int32)) + 4 + 8 * h + 4 * g
        sh = 2 * j
        t0 = tl.load(wp, mask=ok, other=0) >> sh
        t1 = tl.load(wp + 1, mask=ok, other=0) >> sh
        t2 = tl.load(wp + 2, mask=ok, other=0) >> sh
        t3 = tl.load(wp + 3, mask=ok, other=0) >> sh
        a, x = _low_k_sums(t0, t1, t2, t3, xb + 128 * h + 32 * j + 16 * g, 21, 0x600000)
        wb = base.to(tl.pointer_type(tl.int32))
        sm = tl.load(wb + s // 4, mask=ok, other=0) >> (8 * (s % 4))  # scale | min << 4 (a word: see q3_k_dot)
        dd = tl.load(wb + 20, mask=ok, other=0)
        d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        c = (4.0 * d) * _exact_f32(sm & 15)
        return c * a - (c + dmin * _exact_f32((sm >> 4) & 15)) * x

    @triton.jit
    def q3_k_dot(base, xb, ok):
        """A Q3_K block (110 bytes, 2-byte aligned: _words4_at), lanes as in q2_k_dot. Value 128 h + 32 j + l
        is u - 4, u its 2-bit field in qs | bit 4 h + j of hmask[l] << 2 (both joined a word at a time); as
        1 + u / 8: d sc (u - 4) . x = d sc (8 A - 12 X). Sub-block s's 6-bit scale: nibble s // 8 of byte
        96 + s % 8, bits 2 (s // 4).. of byte 104 + s % 4, less 32."""
        s = tl.arange(0, 16)[None, None, :]
        h, j, g = s // 8, s // 2 % 4, s % 2
        q0, q1, q2, q3 = _words4_at(base + 32 + 32 * h + 16 * g, ok)
        m0, m1, m2, m3 = _words4_at(base + 16 * g, ok)
        qs, ms = 2 * j, 4 * h + j
        t0 = ((q0 >> qs) & 0x03030303) | (((m0 >> ms) & 0x01010101) << 2)
        t1 = ((q1 >> qs) & 0x03030303) | (((m1 >> ms) & 0x01010101) << 2)
        t2 = ((q2 >> qs) & 0x03030303) | (((m2 >> ms) & 0x01010101) << 2)
        t3 = ((q3 >> qs) & 0x03030303) | (((m3 >> ms) & 0x01010101) << 2)
        a, x = _low_k_sums(t0, t1, t2, t3, xb + 128 * h + 32 * j + 16 * g, 20, 0x700000)
        # words, not bytes a lane: a byte load along the lanes would be given a layout of its own (a conversion
        # through shared memory every block)
        lo = (_word_at(base + 96 + 4 * (s % 8 // 4), ok) >> (8 * (s % 4) + 4 * (s // 8))) & 15
        hi = (_word_at(base + 104, ok) >> (8 * (s % 4) + 2 * (s // 4))) & 3
        c = _f16_word(base, 108, ok) * _exact_f32((lo | (hi << 4)) - 32)
        return (8.0 * c) * a - (12.0 * c) * x

    @triton.jit
    def q8_0_dot(base, xb, ok):
        lane = tl.arange(0, 32)[None, None, :]
        q = tl.load(base + 2 + lane, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (q * f16_at(base, 0, ok)) * tl.load(xb + lane).to(tl.float32)

    @triton.jit
    def _word_at(p, ok):
        """The int32 of the 4 bytes at p (any alignment): cut from the aligned word holding byte p and, when the
        bytes straddle two, the next one (the only loads that touch a word the bytes do not need)."""
        r = (p.to(tl.int64) & 3).to(tl.int32)
        wp = (p - r).to(tl.pointer_type(tl.int32))
        lo = tl.load(wp, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        hi = tl.load(wp + 1, mask=ok & (r != 0), other=0).to(tl.int64)
        return ((lo | (hi << 32)) >> (8 * r)).to(tl.int32)

    @triton.jit
    def _x_quads(xb, lane):
        """The 4 bfloat16 values of x at 4 lane.. and at 16 + 4 lane.. of a 32-value block, an 8-byte load each
        (x is 16-byte aligned: see matvec.aligned_x); unread (zeros) for a float32 x."""
        if xb.dtype.element_ty == tl.bfloat16:
            lo = tl.load((xb + 4 * lane).to(tl.pointer_type(tl.int64)))
            hi = tl.load((xb + 16 + 4 * lane).to(tl.pointer_type(tl.int64)))
        else:
            lo = tl.zeros_like(lane).to(tl.int64)
            hi = lo
        return lo, hi

    @triton.jit
    def _x_at(xb, quad, at, b: tl.constexpr):
        """x's value b of the quad at element `at` (b..b + 3 of it) as float32: from the packed bfloat16 quad, or
        loaded (a float32 x)."""
        if xb.dtype.element_ty == tl.bfloat16:
            v = _bf16_of(quad, b)
        else:
            v = tl.load(xb + at + b).to(tl.float32)
        return v

    @triton.jit
    def mxfp4_dot(base, xb, ok):
        """An MXFP4 block (17 bytes, any alignment): lane l takes code bytes 4 l..4 l + 3 (elements 4 l + i and
        16 + 4 l + i) as one word (_word_at). The codes become float16 pairs (e2m1_pair: each value times
        2**-14, exactly), so one shift and mask makes two values; the scale multiplies once a block."""
        lane = tl.arange(0, 4)[None, None, :]
        u = _word_at(base + 1 + 4 * lane, ok)
        e = tl.load(base, mask=ok, other=0).to(tl.int32)
        x_lo, x_hi = _x_quads(xb, lane)
        acc = tl.zeros_like(u.to(tl.float32))
        for b in tl.static_range(2):  # bytes b and b + 2: each shift and mask makes their two codes' values
            lo_b, lo_b2 = f16_pair(e2m1_pair(u, 8 * b))
            hi_b, hi_b2 = f16_pair(e2m1_pair(u, 8 * b + 4))
            acc += lo_b * _x_at(xb, x_lo, 4 * lane, b) + lo_b2 * _x_at(xb, x_lo, 4 * lane, b + 2)
            acc += hi_b * _x_at(xb, x_hi, 16 + 4 * lane, b) + hi_b2 * _x_at(xb, x_hi, 16 + 4 * lane, b + 2)
        return (acc * 32768.0) * e8m0_half(e)

    @triton.jit
    def _nibble_sums(u, h, xb, lane, FIFTH: tl.constexpr):
        """For the word u of a 32-value block's nibble bytes 4 lane.. (element 4 lane + b low, 16 + 4 lane + b
        high): A = the sum of (1 + q / 16) x over its 8 values q (with FIFTH, 5-bit q = nibble | bit b (low) or
        16 + b (high) of h << 4, over 32) and X = the sum of x, as _k_dot forms them: q . x = 16 (32) (A - X)."""
        x_lo, x_hi = _x_quads(xb, lane)
        one = 0x3F800000
        for b in tl.static_range(4):
            xl = _x_at(xb, x_lo, 4 * lane, b)
            xh = _x_at(xb, x_hi, 16 + 4 * lane, b)
            if FIFTH:
                f_lo = _bits_to(u, 8 * b, 18, 0x3C0000) | _bits_to(h, b, 22, 0x400000) | one
                f_hi = _bits_to(u, 8 * b + 4, 18, 0x3C0000) | _bits_to(h, 16 + b, 22, 0x400000) | one
            else:
                f_lo = _bits_to(u, 8 * b, 19, 0x780000) | one
                f_hi = _bits_to(u, 8 * b + 4, 19, 0x780000) | one
            if b == 0:
                a = f_lo.to(tl.float32, bitcast=True) * xl + f_hi.to(tl.float32, bitcast=True) * xh
                x = xl + xh
            else:
                a += f_lo.to(tl.float32, bitcast=True) * xl + f_hi.to(tl.float32, bitcast=True) * xh
                x += xl + xh
        return a, x

    @triton.jit
    def _f16_word(base, offset: tl.constexpr, ok):
        """The fp16 at byte offset (even) of 2-byte aligned blocks, as float32: one 16-bit load."""
        return tl.load((base + offset).to(tl.pointer_type(tl.float16)), mask=ok, other=0).to(tl.float32)

    @triton.jit
    def q4_0_dot(base, xb, ok):
        """A Q4_0 block (18 bytes, 2-byte aligned): d (q - 8) . x = 16 d A - 24 d X (_nibble_sums)."""
        lane = tl.arange(0, 4)[None, None, :]
        d = _f16_word(base, 0, ok)
        a, x = _nibble_sums(_word_at(base + 2 + 4 * lane, ok), 0, xb, lane, False)
        return (16.0 * d) * a - (24.0 * d) * x

    @triton.jit
    def q4_1_dot(base, xb, ok):
        """A Q4_1 block (20 bytes, 4-byte aligned: word loads): (d q + m) . x = 16 d A + (m - 16 d) X."""
        lane = tl.arange(0, 4)[None, None, :]
        d, m = _f16_word(base, 0, ok), _f16_word(base, 2, ok)
        u = tl.load((base + 4).to(tl.pointer_type(tl.int32)) + lane, mask=ok, other=0)
        a, x = _nibble_sums(u, 0, xb, lane, False)
        return (16.0 * d) * a + (m - 16.0 * d) * x

    @triton.jit
    def q5_0_dot(base, xb, ok):
        """A Q5_0 block (22 bytes, 2-byte aligned): d (q - 16) . x = 32 d A - 48 d X, the fifth bits from the
        32-bit qh (bit j: element j), shifted so that lane l's are bits 0-3 and 16-19."""
        lane = tl.arange(0, 4)[None, None, :]
        d = _f16_word(base, 0, ok)
        h = _word_at(base + 2, ok) >> (4 * lane)
        a, x = _nibble_sums(_word_at(base + 6 + 4 * lane, ok), h, xb, lane, True)
        return (32.0 * d) * a - (48.0 * d) * x

    @triton.jit
    def q5_1_dot(base, xb, ok):
        """A Q5_1 block (24 bytes, 4-byte aligned: word loads): (d q + m) . x = 32 d A + (m - 32 d) X."""
        lane = tl.arange(0, 4)[None, None, :]
        d, m = _f16_word(base, 0, ok), _f16_word(base, 2, ok)
        wp = (base + 4).to(tl.pointer_type(tl.int32))
        h = tl.load(wp, mask=ok, other=0) >> (4 * lane)
        a, x = _nibble_sums(tl.load(wp + 1 + lane, mask=ok, other=0), h, xb, lane, True)
        return (32.0 * d) * a + (m - 32.0 * d) * x

    @triton.jit
    def _grid_dot(base, xb, ok, table, FIELDS: tl.constexpr, SHIFTED: tl.constexpr):
        """An IQ grid block (kernels/dequant.py's _fields) as [R, B, 8 sub-blocks, 4 groups, 2 quads]: the
        fields load once a sub-block; each lane loads a quad of its grid row from the L1-resident table (a row's
        2 quads are 16 contiguous bytes), XORs its four signs into the four bfloat16 values and takes each
        apart with a shift or an AND, against x's matching quad (one 8-byte load of a bfloat16 x). IQ1's delta
        multiplies the sum of x. Returns [R, B, 8, 4]."""
        base, xb, ok = base[:, :, :, None, None], xb[:, :, :, None, None], ok[:, :, :, None, None]
        s = tl.arange(0, 8)[None, None, :, None, None]
        g = tl.arange(0, 4)[None, None, None, :, None]
        q = tl.arange(0, 2)[None, None, None, None, :]
        if xb.dtype.element_ty == tl.bfloat16:
            x4 = tl.load(xb.to(tl.pointer_type(tl.int64)) + 8 * s + 2 * g + q)
            x0, x1, x2, x3 = _bf16_of(x4, 0), _bf16_of(x4, 1), _bf16_of(x4, 2), _bf16_of(x4, 3)
        else:
            at = xb + 32 * s + 8 * g + 4 * q
            x0, x1 = tl.load(at).to(tl.float32), tl.load(at + 1).to(tl.float32)
            x2, x3 = tl.load(at + 2).to(tl.float32), tl.load(at + 3).to(tl.float32)
        if SHIFTED:
            scale, delta, gq = FIELDS(base, s, g, q, ok, True)
            w = grid_quad(table, gq, gq, q, False)
        else:
            scale, gq, signs = FIELDS(base, s, g, q, ok, True)
            w = grid_quad(table, gq, signs, q, True)
        acc = _bf16_of(w, 0) * x0 + _bf16_of(w, 1) * x1 + _bf16_of(w, 2) * x2 + _bf16_of(w, 3) * x3
        if SHIFTED:
            acc += delta * (x0 + x1 + x2 + x3)
        return tl.sum(scale * acc, axis=4)

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
