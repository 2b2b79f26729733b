"""Quantized matrix-vector products for a few tokens (decode): y = W x straight from the stored blocks.

Dequantizing a weight to bf16 and then multiplying writes and reads it twice more than it is stored; for a
token or two that traffic, plus the extra launches, is the whole cost. These kernels read each block once,
unpack it in registers and accumulate in float32. The blocks may lie in
device memory or in page-locked host memory, which the kernel then reads over the link itself, like
kernels/gather.py. A stack of matrices (experts) is indexed per row of x, with the indices on the device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.kernels.dequant import on_device, pdl, triton

Q = GGMLQuantizationType

# Tiles, from side-by-side sweeps of the graphed decode step on the H200 (scripts/decode_diag.py): 8 rows beat
# 16 and 4; halving them until a launch has two programs per SM (the k/v and o projections, one token) made the
# whole step 1.10x faster (1.281 vs 1.414 ms for 8 layers)
ROWS_PER_PROGRAM = 8
WARPS = 4
PROGRAMS_PER_SM = 2
# Blocks of a row loaded as one tile. Alone in graphs (scripts/matvec_shapes.py, before the rows were unrolled)
# 4 looked faster than 1 for q/k/v; with the rows unrolled, a tile of 4 takes the q/k/v kernel to 168 registers
# a thread (sm_90, offline) and 1 to 56, and the whole resident step went 1.16x faster at 1 (qwen3-30b tg128 on
# the H200, alternating processes, two rounds: 316.0 / 321.9 vs 271.1 / 277.8 tokens/s; docs/benchmarks.md).
# The price is compile time: Triton's coalescing pass grows with the square of an unrolled kernel's size (the
# four-part projection of a qwen3.6 DeltaNet layer: 41 s at 1 against 6 s at 4 on the dev machine), paid once
# per machine (Triton's cache)
BLOCKS_AT_ONCE = 1
GATE_UP_BLOCKS_AT_ONCE = 1
GATE_UP_WARPS = WARPS  # unrolled, gate+up holds 168 registers a thread at 4 warps, 60 at 8 (sm_90, offline)
# Rows of up to this many blocks have their loop unrolled (_row_dot): a 16-block row (the o projection, 4096
# wide) spilled registers when unrolled
UNROLLED = 8
# Float weights (the router) go through the same kernel in blocks of 32 values, 16 blocks a tile: a row of 2048
# in 4 rounds of loads. Not yet timed against cuBLAS's 4.9 us for the router (qwen3-30b, the H200)
FLOAT_BLOCK = 32
FLOAT_BLOCKS_AT_ONCE = 16
FLOAT_QTYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
SUM_BLOCK = 256  # output columns a program of the weighted sum (8 programs for a 2048-wide model)
MAX_TOKENS = 4  # above this, dequantizing once and multiplying on the tensor cores is cheaper

if triton is not None:
    import triton.language as tl

    from moestream.kernels.dequant import _f16_at, pdl_start

    _FLOAT_BLOCK = tl.constexpr(FLOAT_BLOCK)

    # Block dots: base [R, B, 1] points at B consecutive blocks of each of R rows, xb [1, B, 1] at the blocks'
    # slices of x, ok [R, 1, 1] masks rows. Each returns [R, B, W] partial products (summed by the caller). They
    # load the packed bytes as contiguous runs (Q4_K as 32-bit words), each scale once per row, and unpack in
    # registers. (Q6_K's 16-bit words once gained nothing, 1.219 vs 1.202 ms, in a dot that loaded each byte
    # again for every quarter; the one below loads each once.)

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
        """A Q4_K block (144 bytes) read as 36 int32 words: 5 loads a row instead of ~156 byte loads (the
        graphed step 1.13x faster on the H200: 1.066 vs 1.202 ms for 8 layers). Needs 4-byte aligned blocks."""
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
        [R, B, 4, 1] tensor and X one [1, B, 4, 8]. On the H200, with three other changes, no faster than the
        integer-to-float form before it: these launches are bound by registers (docs/benchmarks.md)."""
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
        d = _f16_at(base, 208, ok)
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
        return (q * _f16_at(base, 0, ok)) * tl.load(xb + lane).to(tl.float32)

    DOTS = {Q.Q4_K: q4_k_dot, Q.Q5_K: q5_k_dot, Q.Q6_K: q6_k_dot, Q.Q8_0: q8_0_dot}

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

    FLOAT_DOTS = {Q.F32: f32_dot, Q.F16: f16_dot, Q.BF16: bf16_dot}

    @triton.jit
    def _row_dot(
        w, w2, mat, out, n_out, row_bytes, xp, ok, N_BLOCKS: tl.constexpr, DOT: tl.constexpr, ELEMS, SIZE,
        B: tl.constexpr, UNROLLED: tl.constexpr, PAIR: tl.constexpr,
    ):  # fmt: skip
        """[R] dot products of rows `out` of matrix `mat` of the stack w with the vector at xp, B blocks a row
        at a time (B divides N_BLOCKS), and with PAIR the same rows of the stack w2 (stored alike) beside them.
        A row of up to UNROLLED blocks is unrolled, so the loads of every turn can go out before the first
        one's products, at the price of registers (gate+up 64 -> 168 a thread on sm_90). The sums keep their
        order either way."""
        at = (mat * n_out + out[:, None, None].to(tl.int64)) * row_bytes
        blk = tl.arange(0, B)[None, :, None]
        ok = ok[:, :, None]
        a = DOT(w + at + blk * SIZE, xp + blk * ELEMS, ok)
        b = DOT(w2 + at + blk * SIZE, xp + blk * ELEMS, ok) if PAIR else a
        for j in tl.range(
            1, N_BLOCKS // B, loop_unroll_factor=max(1, N_BLOCKS // B - 1) if N_BLOCKS <= UNROLLED else 1
        ):
            a += DOT(w + at + (j * B + blk) * SIZE, xp + (j * B + blk) * ELEMS, ok)
            if PAIR:
                b += DOT(w2 + at + (j * B + blk) * SIZE, xp + (j * B + blk) * ELEMS, ok)
        return _total(a), _total(b)

    @triton.jit
    def _total(a):
        """The sum of a dot's partial products [R, B, ...] for each of the R rows."""
        if len(a.shape) == 4:
            a = tl.sum(a, axis=3)
        return tl.sum(tl.sum(a, axis=2), axis=1)

    @triton.jit
    def _matvec_kernel(
        w,
        x,
        y,
        mats,
        n_out,
        row_bytes,
        N_BLOCKS: tl.constexpr,  # blocks per row (a handful of sizes per model)
        DOT: tl.constexpr,
        ELEMS: tl.constexpr,
        SIZE: tl.constexpr,
        STACKED: tl.constexpr,
        ROWS: tl.constexpr,
        B: tl.constexpr,
        UNROLLED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)  # which row of x (a token, or a token-expert pair)
        mat = tl.load(mats + p).to(tl.int64) if STACKED else 0
        _part(
            w,
            mat,
            x + p * N_BLOCKS * ELEMS,
            y,
            p,
            tl.program_id(0),
            n_out,
            row_bytes,
            N_BLOCKS,
            DOT,
            ELEMS,
            SIZE,
            ROWS,
            B,
            UNROLLED,
        )

    @triton.jit(noinline=True)
    def _part(w, mat, xp, y, p, block, n_out, row_bytes, N_BLOCKS, DOT, ELEMS, SIZE, ROWS: tl.constexpr, B, UNROLLED):
        """Rows block * ROWS.. of matrix mat of the stack w (one matrix of matvecs' launch: mat 0), for row p
        of x. Not inlined: Triton's coalescing pass grows with the square of a function's size, and a fused
        projection's parts, each unrolled, took it 39-42 s to compile inlined, 7-13 s as calls (sm_90,
        offline, the same loads and load widths)."""
        out = block * ROWS + tl.arange(0, ROWS)
        ok = (out < n_out)[:, None]
        dot, _ = _row_dot(w, w, mat, out, n_out, row_bytes, xp, ok, N_BLOCKS, DOT, ELEMS, SIZE, B, UNROLLED, False)
        tl.store(y + p * n_out + out, dot.to(y.dtype.element_ty), mask=out < n_out)

    @triton.jit
    def _matvecs_kernel(
        x,
        w0,
        y0,
        n0,
        rb0,
        w1,
        y1,
        n1,
        rb1,
        w2,
        y2,
        n2,
        rb2,
        w3,
        y3,
        n3,
        rb3,
        end0,
        end1,
        end2,
        D: tl.constexpr,
        PARTS: tl.constexpr,
        ROWS: tl.constexpr,
        N0: tl.constexpr,
        DOT0: tl.constexpr,
        E0: tl.constexpr,
        S0: tl.constexpr,
        B0: tl.constexpr,
        N1: tl.constexpr,
        DOT1: tl.constexpr,
        E1: tl.constexpr,
        S1: tl.constexpr,
        B1: tl.constexpr,
        N2: tl.constexpr,
        DOT2: tl.constexpr,
        E2: tl.constexpr,
        S2: tl.constexpr,
        B2: tl.constexpr,
        N3: tl.constexpr,
        DOT3: tl.constexpr,
        E3: tl.constexpr,
        S3: tl.constexpr,
        B3: tl.constexpr,
        UNROLLED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Up to four matrices times the same row of x, one launch: program blocks 0..end0 belong to the first,
        end0..end1 to the second, and so on."""
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)
        blk = tl.program_id(0)
        xp = x + p * D
        if blk < end0:
            _part(w0, 0, xp, y0, p, blk, n0, rb0, N0, DOT0, E0, S0, ROWS, B0, UNROLLED)
        elif blk < end1:
            _part(w1, 0, xp, y1, p, blk - end0, n1, rb1, N1, DOT1, E1, S1, ROWS, B1, UNROLLED)
        elif PARTS > 2:
            if blk < end2:
                _part(w2, 0, xp, y2, p, blk - end1, n2, rb2, N2, DOT2, E2, S2, ROWS, B2, UNROLLED)
            elif PARTS > 3:
                _part(w3, 0, xp, y3, p, blk - end2, n3, rb3, N3, DOT3, E3, S3, ROWS, B3, UNROLLED)

    @triton.jit
    def _gate_up_kernel(
        wg,
        wu,
        x,
        h,
        mats,
        n_out,
        row_bytes,
        K,
        N_BLOCKS: tl.constexpr,
        DOT: tl.constexpr,
        ELEMS: tl.constexpr,
        SIZE: tl.constexpr,
        STACKED: tl.constexpr,
        ROWS: tl.constexpr,
        B: tl.constexpr,
        UNROLLED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """h[p] = silu(gate_p x[p // K]) * (up_p x[p // K]) for token-expert pair p (STACKED; a dense gate
        and up pair: p is the token, K 1): one read of x, no copies."""
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)
        out = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = (out < n_out)[:, None]
        mat = tl.load(mats + p).to(tl.int64) if STACKED else 0
        xp = x + (p // K) * N_BLOCKS * ELEMS
        g, u = _row_dot(wg, wu, mat, out, n_out, row_bytes, xp, ok, N_BLOCKS, DOT, ELEMS, SIZE, B, UNROLLED, True)
        tl.store(h + p * n_out + out, (g / (1 + tl.exp(-g)) * u).to(h.dtype.element_ty), mask=out < n_out)

    @triton.jit
    def _weighted_sum_kernel(
        down, w, res, shared, gate, out, D,
        K: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out[t] = sum over k in order of w[t, k] down[t K + k], in float32: one token's sum, the same bits
        whatever else the launch holds (cuBLAS's bmm chose kernels by batch size and alignment). Then, rounded
        to out's dtype as torch rounds each operation on two tensors of it: with SHARED, plus sigmoid(gate[t])
        shared[t] (a shared expert behind its gate; on sm_90 the compiler makes product and sum one bf16 FMA,
        a rounding step from torch's two roundings at most); with RESIDUAL, res[t] plus the whole."""
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            wk = tl.load(w + t * K + k).to(tl.float32)
            acc += wk * tl.load(down + (t * K + k) * D + cols, mask=ok, other=0).to(tl.float32)
        s = acc.to(out.dtype.element_ty)
        if SHARED:
            g = tl.sigmoid(tl.load(gate + t).to(tl.float32)).to(s.dtype)
            scaled = (g.to(tl.float32) * tl.load(shared + t * D + cols, mask=ok, other=0).to(tl.float32)).to(s.dtype)
            s = (s.to(tl.float32) + scaled.to(tl.float32)).to(s.dtype)
        if RESIDUAL:
            s = (tl.load(res + t * D + cols, mask=ok, other=0).to(tl.float32) + s.to(tl.float32)).to(s.dtype)
        tl.store(out + t * D + cols, s, mask=ok)

else:
    DOTS, FLOAT_DOTS = {}, {}


def linear_each_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) of a float w, each row on its own for a few rows (up to MAX_TOKENS): on a GPU through
    matvec (one launch, tiles chosen per row), elsewhere row by row, since cuBLAS picks its kernel, and so its
    rounding, by the row count, and a server's batched decode step must give each sequence the bits of its
    step alone. Larger batches (prefill) multiply at once."""
    if reads_float(x, w):
        return matvec(*float_part(w), x)
    if 1 < x.shape[0] <= MAX_TOKENS:
        return torch.cat([F.linear(row, w) for row in x.split(1)])
    return F.linear(x, w)


def float_part(w: torch.Tensor) -> tuple[torch.Tensor, GGMLQuantizationType, int]:
    """A float weight [out, in] as matvec's (raw bytes, type, rows): its rows read as FLOAT_BLOCK-value blocks."""
    return w.view(torch.uint8), FLOAT_QTYPES[w.dtype], w.shape[0]


def reads_float(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether matvec's float dots serve x [T, in] times the float weight w [out, in]."""
    return (
        0 < x.shape[0] <= MAX_TOKENS
        and x.is_cuda
        and x.dtype == w.dtype
        and FLOAT_QTYPES.get(w.dtype) in FLOAT_DOTS
        and x.shape[-1] % FLOAT_BLOCK == 0
        and w.dim() == 2
        and w.shape[1] == x.shape[-1]
        and w.is_contiguous()
    )


def usable(qtype: GGMLQuantizationType, device: torch.device, n_tokens: int) -> bool:
    """Whether matvec serves n_tokens rows on device against a weight of this type."""
    return qtype in DOTS and device.type == "cuda" and n_tokens <= MAX_TOKENS


def matvec(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    n_out: int,
    x: torch.Tensor,
    mats: torch.Tensor | None = None,
    rows_per_token: int = 1,
) -> torch.Tensor:
    """y [P, n_out] = W_p x[p] for each row p of x [P, in], in x's dtype.

    raw holds the stored bytes of one matrix [n_out, in] (mats None) or of a stack [E, n_out, in], in which
    case mats [P] (int64, on x's device) says which matrix each row of x multiplies. raw may be a CUDA tensor
    or page-locked host memory that the GPU can address. The tile is chosen for one token's rows_per_token
    rows of x, not for all P: the tile orders the sums, and a token's bits must not depend on how many other
    tokens share the launch (a server's batched decode gives each sequence the tokens of its step alone)."""
    row_bytes, consts = _layout(qtype, x.shape[-1], raw, BLOCKS_AT_ONCE)
    x = _x(x)
    y = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    rows, warps = _tile(ROWS_PER_PROGRAM, WARPS, n_out, rows_per_token, _min_programs(x.device))
    grid = (triton.cdiv(n_out, rows), x.shape[0])
    with on_device(x):
        _matvec_kernel[grid](
            raw,
            x,
            y,
            mats if mats is not None else x,  # unread when not stacked
            n_out,
            row_bytes,
            STACKED=mats is not None,
            ROWS=rows,
            UNROLLED=UNROLLED,
            num_warps=warps,
            **consts,
            **pdl(x),
        )
    return y


def matvecs(parts: list[tuple[torch.Tensor, GGMLQuantizationType, int]], x: torch.Tensor) -> list[torch.Tensor]:
    """[matvec(raw, qtype, n_out, x) for each part] in one launch, for 2 to 4 matrices that multiply the same
    x [P, in] (a layer's q, k and v): one launch instead of several, and the small ones share a full grid.
    The tile is chosen from the parts' rows together, for one row of x (see matvec)."""
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"matvecs takes 2 to 4 matrices, not {len(parts)}")
    x = _x(x)
    rows, warps = _tile(ROWS_PER_PROGRAM, WARPS, sum(n for _, _, n in parts), 1, _min_programs(x.device))
    args, consts, ys, ends = [], {}, [], [0]
    for i, (raw, qtype, n_out) in enumerate(parts + parts[-1:] * (4 - len(parts))):  # unused slots: never read
        row_bytes, c = _layout(qtype, x.shape[-1], raw, BLOCKS_AT_ONCE)
        if i < len(parts):
            ys.append(torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device))
            ends.append(ends[-1] + triton.cdiv(n_out, rows))  # the part's program blocks end here
        args += [raw, ys[-1], n_out, row_bytes]
        consts |= {
            f"N{i}": c["N_BLOCKS"],
            f"DOT{i}": c["DOT"],
            f"E{i}": c["ELEMS"],
            f"S{i}": c["SIZE"],
            f"B{i}": c["B"],
        }
    ends += ends[-1:] * (4 - len(parts))
    with on_device(x):
        _matvecs_kernel[(ends[-1], x.shape[0])](
            x,
            *args,
            *ends[1:4],
            D=x.shape[-1],
            PARTS=len(parts),
            ROWS=rows,
            UNROLLED=UNROLLED,
            num_warps=warps,
            **consts,
            **pdl(x),
        )
    return ys


def _x(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned: the K-quant dots load a bfloat16 x 4 or 2 values at a time, which a
    view starting inside a word would fault on (the engine's own tensors are aligned already)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _layout(qtype: GGMLQuantizationType, n_in: int, raw: torch.Tensor, at_most: int) -> tuple[int, dict]:
    """The bytes a stored row of n_in elements takes, and the kernels' compile-time constants for it. Every
    buffer the engine hands in is its own allocation or a map of 32-byte aligned tensor data, so the K-quant
    dots' word loads are aligned; a view that is not would read wrong words, hence the check."""
    align = {Q.Q4_K: 4, Q.Q5_K: 4, Q.Q6_K: 2}.get(qtype, 1)  # the dots' word loads
    if raw.data_ptr() % align:
        raise ValueError(f"{qtype.name} blocks must start {align}-byte aligned for the quantized matvec (pass a copy)")
    if qtype in FLOAT_DOTS:  # a float weight, read in blocks of FLOAT_BLOCK values
        block, type_size, at_most = FLOAT_BLOCK, FLOAT_BLOCK * GGML_QUANT_SIZES[qtype][1], FLOAT_BLOCKS_AT_ONCE
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
    dot = DOTS[qtype] if qtype in DOTS else FLOAT_DOTS[qtype]
    if n_in % block:
        raise ValueError(f"{qtype.name} rows of {n_in} values are not whole blocks of {block}")
    n_blocks = n_in // block
    at_once = _at_once(n_blocks, at_most)
    return n_blocks * type_size, dict(N_BLOCKS=n_blocks, DOT=dot, ELEMS=block, SIZE=type_size, B=at_once)


def _at_once(n_blocks: int, at_most: int) -> int:
    """Blocks of a row loaded together: the largest power of two up to at_most that divides n_blocks."""
    at_once = 1
    while at_once < at_most and n_blocks % (2 * at_once) == 0:
        at_once *= 2
    return at_once


def _min_programs(device: torch.device) -> int:
    """PROGRAMS_PER_SM programs for each multiprocessor of device (0 for the CPU, where Triton interprets)."""
    return _multiprocessors(device) * PROGRAMS_PER_SM


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _tile(rows: int, warps: int, n_out: int, n_vectors: int, min_programs: int) -> tuple[int, int]:
    """Output rows and warps a program: fewer of both while the grid would have under min_programs programs
    (a small matrix, such as a 512-row k projection, then still spreads over the GPU). Each pair is its own
    compiled kernel: a few per weight shape."""
    while rows > 1 and -(-n_out // rows) * n_vectors < min_programs:
        rows //= 2
        warps = max(1, warps // 2)
    return rows, warps


def swiglu(
    x: torch.Tensor, raws: list[torch.Tensor], qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType], n_ff: int
) -> torch.Tensor:
    """silu(gate x) * (up x) of a dense gate and up pair stored alike (a shared expert), in one launch:
    h [T, n_ff] in x's dtype."""
    if raws[0].shape != raws[1].shape or qtypes[0] != qtypes[1]:
        raise ValueError(f"gate {tuple(raws[0].shape)} {qtypes[0].name} and up {tuple(raws[1].shape)} differ")
    return _gate_up(x, raws, qtypes, n_ff, None, 1)


def _gate_up(
    x: torch.Tensor,
    raws: list[torch.Tensor],
    qtypes: tuple,
    n_ff: int,
    picks: torch.Tensor | None,
    K: int,
) -> torch.Tensor:
    """h [P, n_ff] = silu(gate x) * (up x) for each pair p: the gate and up matrices picks[p] of the stacks
    (picks None: one matrix each), times x[p // K]."""
    D = x.shape[-1]
    x = _x(x)
    P = x.shape[0] * K
    h = torch.empty((P, n_ff), dtype=x.dtype, device=x.device)
    gate_row, gate_consts = _layout(qtypes[0], D, raws[0], GATE_UP_BLOCKS_AT_ONCE)  # up is stored alike (fuses)
    _layout(qtypes[1], D, raws[1], 1)  # only to check up's alignment
    rows, warps = _tile(ROWS_PER_PROGRAM, GATE_UP_WARPS, n_ff, K, _min_programs(x.device))  # a token's: see matvec
    with on_device(x):
        _gate_up_kernel[(triton.cdiv(n_ff, rows), P)](
            raws[0],
            raws[1],
            x,
            h,
            x if picks is None else picks,  # unread without picks
            n_ff,
            gate_row,
            K,
            STACKED=picks is not None,
            ROWS=rows,
            UNROLLED=UNROLLED,
            num_warps=warps,
            **gate_consts,
            **pdl(x),
        )
    return h


def swiglu_picked(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    raws: list[torch.Tensor],
    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType],
    n_ff: int,
    residual: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """models.layers.moe_swiglu_picked in three launches: gate, up and SiLU of every token-expert pair in one,
    each pair's down product in the next (a step 1.07x faster than with one kernel looping over a token's
    experts, side by side on the H200), then the weighted sum over each token's experts. Each pair's down
    product is rounded to x's dtype before the sum, as in the torch form. Nothing in it depends on the other
    tokens of the batch (see matvec). x [T, D]; weights, ids [T, K]; raws the gate, up, down stacks' stored
    bytes (device or page-locked host memory), by ids. shared (out [T, D], gate logit [T, 1]) and residual
    [T, D], if given, are added in the sum's launch, as moe_stored adds them (see there)."""
    T, K = ids.shape
    D = x.shape[-1]
    like = (
        ("residual", residual, x.shape),
        ("shared", shared and shared[0], x.shape),
        ("shared gate", shared and shared[1], (T, 1)),
    )
    for name, t, shape in like:  # a broadcast one would be read past its end
        if t is not None and (t.shape != shape or t.dtype != x.dtype):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} is not like x: {tuple(shape)} {x.dtype}")
    picks = ids.reshape(-1).contiguous()
    h = _gate_up(x, raws, qtypes, n_ff, picks, K)
    down = matvec(raws[2], qtypes[2], D, h, picks, K)  # [T*K, D]: each pair's own programs, a wide grid
    out = torch.empty_like(x)
    with on_device(x):
        _weighted_sum_kernel[(T, triton.cdiv(D, SUM_BLOCK))](
            down,
            weights.contiguous(),
            out if residual is None else residual.contiguous(),  # unread without a residual
            out if shared is None else shared[0].contiguous(),  # unread without a shared expert
            out if shared is None else shared[1].contiguous(),
            out,
            D,
            K=K,
            BLOCK=SUM_BLOCK,
            RESIDUAL=residual is not None,
            SHARED=shared is not None,
            num_warps=4,
            **pdl(x),
        )
    return out


def fuses(qtypes) -> bool:
    """Whether swiglu_picked serves experts of these (gate, up, down) types: gate and up stored alike."""
    g, u, d = qtypes
    return g == u and g in DOTS and d in DOTS
