"""Dequantize expert stacks on the GPU in one pass.

The torch reference (formats/quants) is bit-exact with gguf but runs a dozen elementwise kernels per tensor;
these Triton kernels read each block once and write the output once, so a layer's experts dequantize at
memory speed. Types without a tile (formats/quants names each type's), and the CPU, use the reference.
Kernels may contract multiply-add into FMA, so they agree with the reference to float32 rounding, not bit for
bit; every GPU path uses the same kernel, so schedules still agree exactly.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.formats import quants
from moestream.formats.quants.nonlinear import IQ4_VALUES
from moestream.kernels import tuning
from moestream.kernels.launch import INTERPRETED, on_device, triton


def _iq4_words() -> tuple[int, ...]:
    """IQ4_VALUES plus 128 (so unsigned bytes), 4 to an int32 word, little-endian."""
    b = [v + 128 for v in IQ4_VALUES]
    words = [b[i] | b[i + 1] << 8 | b[i + 2] << 16 | b[i + 3] << 24 for i in range(0, 16, 4)]
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


if triton is not None:
    import triton.language as tl

    _INTERPRETED = tl.constexpr(INTERPRETED)
    _IQ4_0, _IQ4_1, _IQ4_2, _IQ4_3 = (tl.constexpr(w) for w in _iq4_words())

    @triton.jit
    def byte_perm(a, b, s):
        """PTX's prmt.b32: byte i of the result is byte (s >> 4 i) & 7 of the 8 bytes b:a (a's first); bit 3
        of each selector must be clear (prmt would copy the byte's sign instead). One instruction on the GPU;
        the same in plain operations under Triton's interpreter, which runs no PTX."""
        if _INTERPRETED:
            r = s & 0
            for i in tl.static_range(4):
                sel = (s >> (4 * i)) & 7
                r |= ((tl.where(sel < 4, a, b) >> (8 * (sel & 3))) & 0xFF) << (8 * i)
        else:
            r = tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, s], dtype=tl.int32, is_pure=True, pack=1
            )
        return r

    @triton.jit
    def iq4_bytes(u):
        """The IQ4 values plus 128 of the 8 nibbles of the int32 u, by table lookups in registers: words (lo, hi),
        byte i of lo that of the low nibble of u's byte i, of hi its high nibble's. The low 3 bits of each
        nibble pick a byte of the table's first 8 and of its last 8 values, bit 3 between the two."""
        t0, t1 = tl.full(u.shape, _IQ4_0, tl.int32), tl.full(u.shape, _IQ4_1, tl.int32)
        t2, t3 = tl.full(u.shape, _IQ4_2, tl.int32), tl.full(u.shape, _IQ4_3, tl.int32)
        s = u & 0x77777777
        pick = 0x32103210 | ((u >> 1) & 0x44444444)
        w0 = byte_perm(byte_perm(t0, t1, s), byte_perm(t2, t3, s), pick)  # bytes 0-1's low, high, low, high
        s, pick = s >> 16, pick >> 16
        w1 = byte_perm(byte_perm(t0, t1, s), byte_perm(t2, t3, s), pick)  # bytes 2-3's
        lows, highs = tl.full(u.shape, 0x6420, tl.int32), tl.full(u.shape, 0x7531, tl.int32)
        return byte_perm(w0, w1, lows), byte_perm(w0, w1, highs)

    @triton.jit
    def byte_value(w, k: tl.constexpr, offset: tl.constexpr):
        """Byte k of the int32 w less offset, as float32, exactly and without I2F: the float 2**23 + byte (the
        byte under the exponent of 2**23) less 2**23 + offset."""
        return (((w >> (8 * k)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def f16_at(base, offset, ok):
        lo = tl.load(base + offset, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(base + offset + 1, mask=ok, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    # Tiles: base [R, 1] points at R blocks, e [1, B] is the element index within a block, ok [R, 1] masks
    # blocks; each returns the [R, B] float32 values. The dequant and matvec kernels share them.

    @triton.jit
    def _low_k_field(base, e, ok):
        """Value e's 2-bit field in the 64 bytes at base (Q2_K, Q3_K): half e // 128, byte e % 32, bits
        2 (e % 128 // 32)."""
        byte = tl.load(base + (e // 128) * 32 + e % 32, mask=ok, other=0).to(tl.int32)
        return (byte >> ((e % 128 // 32) * 2)) & 3

    @triton.jit
    def q2_k_tile(base, e, ok):
        s = tl.load(base + e // 16, mask=ok, other=0).to(tl.int32)  # sub-block of 16: scale | min << 4
        dl = f16_at(base, 80, ok) * (s & 15).to(tl.float32)
        ml = f16_at(base, 82, ok) * (s >> 4).to(tl.float32)
        return _low_k_field(base + 16, e, ok).to(tl.float32) * dl - ml

    @triton.jit
    def q3_k_tile(base, e, ok):
        s = e // 16
        lo = (tl.load(base + 96 + s % 8, mask=ok, other=0).to(tl.int32) >> ((s // 8) * 4)) & 15
        hi = (tl.load(base + 104 + s % 4, mask=ok, other=0).to(tl.int32) >> ((s // 4) * 2)) & 3
        dl = f16_at(base, 108, ok) * ((lo | (hi << 4)) - 32).to(tl.float32)
        bit = (tl.load(base + e % 32, mask=ok, other=0).to(tl.int32) >> (e // 32)) & 1  # clear: 4 less
        return ((_low_k_field(base + 32, e, ok) | (bit << 2)) - 4).to(tl.float32) * dl

    @triton.jit
    def q4_k_tile(base, e, ok):
        return _k_tile(base, e, ok, False)

    @triton.jit
    def q5_k_tile(base, e, ok):
        return _k_tile(base, e, ok, True)

    @triton.jit
    def _k_tile(base, e, ok, FIFTH: tl.constexpr):
        """Q4_K, or with FIFTH Q5_K: the same scales and nibbles (32 bytes later) plus a fifth bit, bit s of
        qh[e % 32] for sub-block s."""
        d, dmin = f16_at(base, 0, ok), f16_at(base, 2, ok)
        s = e // 32  # sub-block of 32 with its own 6-bit scale and min
        lo = s < 4
        a = tl.load(base + 4 + s % 4, mask=ok, other=0).to(tl.int32)  # scales[0:4]
        m = tl.load(base + 8 + s % 4, mask=ok, other=0).to(tl.int32)  # scales[4:8]
        md = tl.load(base + 12 + s % 4, mask=ok, other=0).to(tl.int32)  # scales[8:12]
        sc = tl.where(lo, a & 63, (md & 15) | ((a >> 6) << 4))
        mn = tl.where(lo, m & 63, (md >> 4) | ((m >> 6) << 4))
        byte = tl.load(base + (48 if FIFTH else 16) + (s // 2) * 32 + e % 32, mask=ok, other=0).to(tl.int32)
        q = (byte >> ((s % 2) * 4)) & 15
        if FIFTH:
            q |= ((tl.load(base + 16 + e % 32, mask=ok, other=0).to(tl.int32) >> s) & 1) << 4
        return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)

    @triton.jit
    def q6_k_tile(base, e, ok):
        d = f16_at(base, 208, ok)
        h, r = e // 128, e % 128  # two halves of 128; each packs low nibbles in ql and 2 high bits in qh
        ql = tl.load(base + h * 64 + r % 64, mask=ok, other=0).to(tl.int32)
        qh = tl.load(base + 128 + h * 32 + r % 32, mask=ok, other=0).to(tl.int32)
        q = (((ql >> ((r // 64) * 4)) & 15) | (((qh >> ((r // 32) * 2)) & 3) << 4)) - 32
        sc = tl.load(base + 192 + e // 16, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (d * sc) * q.to(tl.float32)

    @triton.jit
    def q8_0_tile(base, e, ok):
        q = tl.load(base + 2 + e, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return q * f16_at(base, 0, ok)

    # The IQ grid types (formats/quants/grids.py). Group g (0..3) of 8 values of sub-block s (0..7) of 32 has
    # a scale, a grid row in the type's kernel_table, read as 8-byte quads (quad q of a row holds values
    # 4 q .. 4 q + 3 as bfloat16), and a byte of signs (bit j: value j negative), made in registers: a table
    # of sign masks was a second scattered load a quad. The _fields functions give, for tensors s, g and q
    # (broadcast against base), the group's scale, the table offset in quads of quad q of its grid row and
    # its sign byte. They load whole 16- and 32-bit fields of the sub-block and shift the group's bits out, so
    # the dots' loads are per sub-block. WORDS loads a 16-bit field as such (the dots: blocks 2-byte aligned),
    # otherwise as two bytes (the tiles: any buffer).

    @triton.jit
    def _byte(base, offset, ok):
        return tl.load(base + offset, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _u16(base, offset, ok, WORDS: tl.constexpr):
        """The little-endian 16-bit field at an even byte offset, as int32."""
        if WORDS:
            v = tl.load((base + offset).to(tl.pointer_type(tl.int16)), mask=ok, other=0).to(tl.int32) & 0xFFFF
        else:
            v = _byte(base, offset, ok) | (_byte(base, offset + 1, ok) << 8)
        return v

    @triton.jit
    def _u32(base, offset, ok, WORDS: tl.constexpr):
        """The little-endian 32-bit field at an even byte offset, as int32."""
        return _u16(base, offset, ok, WORDS) | (_u16(base, offset + 2, ok, WORDS) << 16)

    @triton.jit
    def _byte_of(base, offset, i, ok, WORDS: tl.constexpr):
        """Byte offset + i (offset even) through the 16-bit field holding it."""
        return (_u16(base, offset + 2 * (i // 2), ok, WORDS) >> (8 * (i % 2))) & 255

    @triton.jit
    def _half_of(base, offset, g, ok, WORDS: tl.constexpr):
        """16-bit field g (0..3) of the 8 bytes at offset, through the two 32-bit fields there."""
        w = tl.where(g < 2, _u32(base, offset, ok, WORDS), _u32(base, offset + 4, ok, WORDS))
        return (w >> (16 * (g % 2))) & 0xFFFF

    @triton.jit
    def _f16(base, ok, WORDS: tl.constexpr):
        """The fp16 d at byte 0, as float32."""
        return _u16(base, 0, ok, WORDS).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _index_signs(i):
        """The sign byte a 7-bit sign index names: its bits, and an eighth that makes the count of minus signs
        even (gguf's ksigns)."""
        p = i ^ (i >> 4)
        p ^= p >> 2
        p ^= p >> 1
        return i | ((p & 1) << 7)

    @triton.jit
    def _quarter(d, sc):
        """d (1/2 + sc) / 4, the IQ2 scale, in the reference's order of products."""
        return d * (0.5 + sc.to(tl.float32)) * 0.25

    @triton.jit
    def iq2_xxs_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Per sub-block two 32-bit fields at 2 + 8 s: 4 index bytes; 4 7-bit sign indices and the scale."""
        index = (_u32(base, 2 + 8 * s, ok, WORDS) >> (8 * g)) & 255
        aux = _u32(base, 6 + 8 * s, ok, WORDS)
        db = _quarter(_f16(base, ok, WORDS), (aux >> 28) & 15)
        return db, index * 2 + q, _index_signs((aux >> (7 * g)) & 127)

    @triton.jit
    def iq2_xs_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """A 16-bit field a group at 2 (9-bit grid index, 7-bit sign index); a byte of two 4-bit scales per
        sub-block at 66."""
        v = _half_of(base, 2 + 8 * s, g, ok, WORDS)
        db = _quarter(_f16(base, ok, WORDS), (_byte_of(base, 66, s, ok, WORDS) >> (4 * (g // 2))) & 15)
        return db, (v & 511) * 2 + q, _index_signs(v >> 9)

    @triton.jit
    def iq2_s_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Index low bytes at 2, sign bytes at 34 (4 a sub-block), a byte of 2 high index bits a group per
        sub-block at 66, one of two 4-bit scales at 74."""
        high = (_byte_of(base, 66, s, ok, WORDS) >> (2 * g)) & 3
        db = _quarter(_f16(base, ok, WORDS), (_byte_of(base, 74, s, ok, WORDS) >> (4 * (g // 2))) & 15)
        index = ((_u32(base, 2 + 4 * s, ok, WORDS) >> (8 * g)) & 255) | (high << 8)
        signs = (_u32(base, 34 + 4 * s, ok, WORDS) >> (8 * g)) & 255
        return db, index * 2 + q, signs

    @triton.jit
    def iq3_xxs_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Two index bytes a group (rows of 4 values: quads 0 and 1) at 2; per sub-block a 32-bit field at 66
        of 4 7-bit sign indices and the scale."""
        pair = _half_of(base, 2 + 8 * s, g, ok, WORDS)
        aux = _u32(base, 66 + 4 * s, ok, WORDS)
        db = _f16(base, ok, WORDS) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        row = tl.where(q == 0, pair & 255, pair >> 8)
        return db, row, _index_signs((aux >> (7 * g)) & 127)

    @triton.jit
    def iq3_s_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Two index low bytes a group at 2, a byte of their ninth bits per sub-block at 66, sign bytes at 74,
        4-bit scales at 106 (one per sub-block)."""
        pair = _half_of(base, 2 + 8 * s, g, ok, WORDS)
        high = _byte_of(base, 66, s, ok, WORDS) >> (2 * g)
        sc = (_byte_of(base, 106, s // 2, ok, WORDS) >> (4 * (s % 2))) & 15
        row = tl.where(q == 0, (pair & 255) | ((high & 1) << 8), (pair >> 8) | ((high & 2) << 7))
        db = _f16(base, ok, WORDS) * (1 + 2 * sc).to(tl.float32)
        signs = (_u32(base, 74 + 4 * s, ok, WORDS) >> (8 * g)) & 255
        return db, row, signs

    @triton.jit
    def iq1_s_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Index low bytes at 2; per sub-block a 16-bit field at 34: 3 high index bits a group, a 3-bit scale,
        the delta's sign. Returns the scale d (2 s + 1), the delta and the grid quad."""
        qh = _u16(base, 34 + 2 * s, ok, WORDS)
        index = ((_u32(base, 2 + 4 * s, ok, WORDS) >> (8 * g)) & 255) | (((qh >> (3 * g)) & 7) << 8)
        dl = _f16(base, ok, WORDS) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        return dl, tl.where(qh >> 15 == 0, 0.125, -0.125), index * 2 + q

    @triton.jit
    def iq1_m_fields(base, s, g, q, ok, WORDS: tl.constexpr):
        """Index low bytes at 0, per sub-block 16 bits at 32 of a nibble a group (3 high index bits, the
        delta's sign), 3-bit scales per 16 in 4 16-bit fields at 48 whose top nibbles make d."""
        nibble = _u16(base, 32 + 2 * s, ok, WORDS) >> (4 * g)
        sc = _u16(base, 48 + 2 * (s // 2), ok, WORDS) >> (6 * (s % 2) + 3 * (g // 2))
        bits = (_u16(base, 48, ok, WORDS) >> 12) | ((_u16(base, 50, ok, WORDS) >> 12) << 4)
        bits |= ((_u16(base, 52, ok, WORDS) >> 12) << 8) | ((_u16(base, 54, ok, WORDS) >> 12) << 12)
        d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dl = d * (2 * (sc & 7) + 1).to(tl.float32)
        index = ((_u32(base, 4 * s, ok, WORDS) >> (8 * g)) & 255) | ((nibble & 7) << 8)
        return dl, tl.where((nibble & 8) == 0, 0.125, -0.125), index * 2 + q

    @triton.jit
    def grid_quad(table, grid_quad, signs, q, SIGNED: tl.constexpr):
        """Four values as the bfloat16 quarters of an int64 (lowest: the first), quad q's four bits of the sign
        byte applied: multiplying by 1 + 2**15 + 2**30 + 2**45 puts bit j at 16 j (no two copies overlap, so no
        carries), the AND keeps those, the shift moves them to each quarter's sign bit, and XOR flips it."""
        w = tl.load(table.to(tl.pointer_type(tl.int64)) + grid_quad)
        if SIGNED:
            nibble = ((signs >> (4 * q)) & 15).to(tl.int64)
            w ^= ((nibble * 0x200040008001) & 0x1000100010001) << 15
        return w

    @triton.jit
    def _quarter_of(w, e):
        """The float32 of element e's bfloat16 quarter of the int64 w (quarter e % 4)."""
        half = tl.where(e % 4 < 2, w, w >> 32).to(tl.int32)
        return tl.where(e % 2 == 1, half & -65536, half << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _signed_tile(base, e, ok, table, FIELDS: tl.constexpr):
        q = (e % 8) // 4
        db, gq, signs = FIELDS(base, e // 32, (e // 8) % 4, q, ok, False)
        return db * _quarter_of(grid_quad(table, gq, signs, q, True), e)

    @triton.jit
    def _shifted_tile(base, e, ok, table, FIELDS: tl.constexpr):
        dl, delta, gq = FIELDS(base, e // 32, (e // 8) % 4, (e % 8) // 4, ok, False)
        return dl * (_quarter_of(grid_quad(table, gq, gq, 0, False), e) + delta)

    @triton.jit
    def iq2_xxs_tile(base, e, ok, table):
        return _signed_tile(base, e, ok, table, iq2_xxs_fields)

    @triton.jit
    def iq2_xs_tile(base, e, ok, table):
        return _signed_tile(base, e, ok, table, iq2_xs_fields)

    @triton.jit
    def iq2_s_tile(base, e, ok, table):
        return _signed_tile(base, e, ok, table, iq2_s_fields)

    @triton.jit
    def iq3_xxs_tile(base, e, ok, table):
        return _signed_tile(base, e, ok, table, iq3_xxs_fields)

    @triton.jit
    def iq3_s_tile(base, e, ok, table):
        return _signed_tile(base, e, ok, table, iq3_s_fields)

    @triton.jit
    def iq1_s_tile(base, e, ok, table):
        return _shifted_tile(base, e, ok, table, iq1_s_fields)

    @triton.jit
    def iq1_m_tile(base, e, ok, table):
        return _shifted_tile(base, e, ok, table, iq1_m_fields)

    @triton.jit
    def block_tile(TILE: tl.constexpr, base, e, ok, table, TABLE: tl.constexpr):
        """TILE's values; a type with a lookup table (TABLE) gets it as a fourth argument."""
        if TABLE:
            x = TILE(base, e, ok, table)
        else:
            x = TILE(base, e, ok)
        return x

    @triton.jit
    def _nibble32(base, e, ok):
        """Value e's nibble of the 16 bytes at base (low nibbles elements 0..15, high 16..31), as int32."""
        return (tl.load(base + e % 16, mask=ok, other=0).to(tl.int32) >> ((e // 16) * 4)) & 15

    @triton.jit
    def _bit32(base, e, ok):
        """Bit e of the little-endian 32-bit field at base, as int32."""
        return (tl.load(base + e // 8, mask=ok, other=0).to(tl.int32) >> (e % 8)) & 1

    @triton.jit
    def q4_0_tile(base, e, ok):
        return (_nibble32(base + 2, e, ok) - 8).to(tl.float32) * f16_at(base, 0, ok)

    @triton.jit
    def _iq4_value(n):
        """The IQ4 value of nibble(s) n (int32), as float32."""
        lo, _ = iq4_bytes(n)
        return byte_value(lo, 0, 128)

    @triton.jit
    def iq4_nl_tile(base, e, ok):
        return _iq4_value(_nibble32(base + 2, e, ok)) * f16_at(base, 0, ok)

    @triton.jit
    def iq4_xs_tile(base, e, ok):
        """IQ4_XS: sub-block i = e // 32 has scale ((scales_l nibble i) | (scales_h bits 2 i) << 4) - 32."""
        i = e // 32
        lo = (tl.load(base + 4 + i // 2, mask=ok, other=0).to(tl.int32) >> ((i % 2) * 4)) & 15
        hi = (tl.load(base + 2 + i // 4, mask=ok, other=0).to(tl.int32) >> ((i % 4) * 2)) & 3
        dl = f16_at(base, 0, ok) * ((lo | (hi << 4)) - 32).to(tl.float32)
        return dl * _iq4_value(_nibble32(base + 8 + i * 16, e % 32, ok))

    @triton.jit
    def tq1_0_tile(base, e, ok):
        """TQ1_0: value e's byte and power of 3 (see formats/quants/ternary.py), the trit the top of
        (byte * 3**k mod 256) * 3 / 256."""
        a, b = e < 160, e < 240
        at = tl.where(a, e % 32, tl.where(b, 32 + (e - 160) % 16, 48 + (e - 240) % 4))
        k = tl.where(a, e // 32, tl.where(b, (e - 160) // 16, (e - 240) // 4))
        pow3 = tl.where(k == 0, 1, tl.where(k == 1, 3, tl.where(k == 2, 9, tl.where(k == 3, 27, 81))))
        v = tl.load(base + at, mask=ok, other=0).to(tl.int32)
        q = (((v * pow3) & 0xFF) * 3) >> 8
        return (q - 1).to(tl.float32) * f16_at(base, 52, ok)

    @triton.jit
    def tq2_0_tile(base, e, ok):
        return (_low_k_field(base, e, ok) - 1).to(tl.float32) * f16_at(base, 64, ok)

    @triton.jit
    def q4_1_tile(base, e, ok):
        return _nibble32(base + 4, e, ok).to(tl.float32) * f16_at(base, 0, ok) + f16_at(base, 2, ok)

    @triton.jit
    def q5_0_tile(base, e, ok):
        q = _nibble32(base + 6, e, ok) | (_bit32(base + 2, e, ok) << 4)
        return (q - 16).to(tl.float32) * f16_at(base, 0, ok)

    @triton.jit
    def q5_1_tile(base, e, ok):
        q = _nibble32(base + 8, e, ok) | (_bit32(base + 4, e, ok) << 4)
        return q.to(tl.float32) * f16_at(base, 0, ok) + f16_at(base, 2, ok)

    @triton.jit
    def e8m0_half(e):
        """Half the E8M0 scale of exponent byte(s) e (int32): 2**(e - 128), a subnormal for e 0 and 1."""
        return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def e2m1_pair(v, s: tl.constexpr):
        """The two E2M1 codes at bits s..s + 3 and s + 16..s + 19 of the int32 v as a float16 pair: the sign to
        bit 15, the 2-bit exponent and the mantissa bit to bits 10-11 and 9. Float16's exponent bias and
        subnormals then give each code's value times 2**-14, exactly; split with f16_pair."""
        mag = _shift(v, 9 - s) & 0x0E000E00
        sign = _shift(v, 12 - s) & -2147450880  # 0x80008000: both halves' sign bits
        return mag | sign

    @triton.jit
    def f16_pair(v):
        """The float16 halves (low, high) of the int32 v, as float32."""
        lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _shift(v, n: tl.constexpr):
        """v shifted left by n bits, right (logically) for a negative n."""
        if n >= 0:
            r = v << n
        else:
            r = (v.to(tl.uint32, bitcast=True) >> -n).to(tl.int32, bitcast=True)
        return r

    @triton.jit
    def mxfp4_tile(base, e, ok):
        """MXFP4: e E8M0 at byte 0, then 16 bytes of E2M1 codes (low nibbles elements 0..15, high 16..31)."""
        lo, _ = f16_pair(e2m1_pair(_nibble32(base + 1, e, ok), 0))
        scale = e8m0_half(tl.load(base, mask=ok, other=0).to(tl.int32))
        # The doubled code's value (exact) times the halved scale, as gguf forms it; + 0 makes code 8's -0 a 0
        return (lo * 32768.0) * scale + 0.0

    @triton.jit
    def _dequant_kernel(
        src, dst, n_blocks, table, TILE: tl.constexpr, TABLE: tl.constexpr, ELEMS: tl.constexpr,
        SIZE: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1] block index
        e = tl.arange(0, ELEMS)[None, :]  # [1, ELEMS] element within the block
        ok = b < n_blocks
        x = block_tile(TILE, src + b.to(tl.int64) * SIZE, e, ok, table, TABLE)
        tl.store(dst + b.to(tl.int64) * ELEMS + e, x.to(dst.dtype.element_ty), mask=ok)

    TILES = {t.qtype: globals()[t.tile] for t in quants.TYPES.values() if t.tile}  # by the names formats gives
else:
    TILES = {}


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Like quants.dequantize; one Triton kernel where there is one for this type and device."""
    if qtype not in TILES or not raw.is_cuda:
        return quants.dequantize(raw, qtype, shape, dtype)
    return tiled(raw, qtype, shape, dtype)


def tiled(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """dequantize through qtype's tile on raw's device (the CPU only under Triton's interpreter)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = raw.contiguous()
    n_blocks = raw.numel() // type_size
    if n_blocks * block != torch.Size(shape).numel():
        return quants.dequantize(raw, qtype, shape, dtype)  # raises the reference's clear error
    out = torch.empty(shape, dtype=dtype, device=raw.device)
    blocks = tuning.current().dequant_blocks_per_program
    with on_device(raw):
        _dequant_kernel[(triton.cdiv(n_blocks, blocks),)](
            raw, out, n_blocks, **table_args(qtype, raw), TILE=TILES[qtype], ELEMS=block, SIZE=type_size, BLOCKS=blocks
        )
    return out


def table_args(qtype: GGMLQuantizationType, like: torch.Tensor) -> dict:
    """The `table` and `TABLE` arguments of a launch reading qtype: its lookup table on like's device, or like
    itself (never read) for a type without one."""
    make = quants.get(qtype).table
    return dict(table=like if make is None else make(like.device), TABLE=make is not None)
