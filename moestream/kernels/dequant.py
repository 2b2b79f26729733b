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
from moestream.kernels import tuning
from moestream.kernels.launch import on_device, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def f16_at(base, offset, ok):
        lo = tl.load(base + offset, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(base + offset + 1, mask=ok, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    # Tiles: base [R, 1] points at R blocks, e [1, B] is the element index within a block, ok [R, 1] masks
    # blocks; each returns the [R, B] float32 values. The dequant and matvec kernels share them.

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
        src, dst, n_blocks, TILE: tl.constexpr, ELEMS: tl.constexpr, SIZE: tl.constexpr, BLOCKS: tl.constexpr
    ):
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1] block index
        e = tl.arange(0, ELEMS)[None, :]  # [1, ELEMS] element within the block
        ok = b < n_blocks
        x = TILE(src + b.to(tl.int64) * SIZE, e, ok)
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
    tile = TILES[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = raw.contiguous()
    n_blocks = raw.numel() // type_size
    if n_blocks * block != torch.Size(shape).numel():
        return quants.dequantize(raw, qtype, shape, dtype)  # raises the reference's clear error
    out = torch.empty(shape, dtype=dtype, device=raw.device)
    blocks = tuning.current().dequant_blocks_per_program
    with on_device(raw):
        _dequant_kernel[(triton.cdiv(n_blocks, blocks),)](
            raw, out, n_blocks, TILE=tile, ELEMS=block, SIZE=type_size, BLOCKS=blocks
        )
    return out
