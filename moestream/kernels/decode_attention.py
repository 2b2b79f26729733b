"""Decode attention in two Triton launches: split-K ("flash-decoding") chunks, then a log-sum-exp combine; one
launch when the keys make a single chunk (buckets under twice the tuning's attention_min_chunk: short
sequences, such as tg128). gpt-oss's options come along: per-head sinks (a logit in each softmax with no
value, added where the softmax is normalised) and a sliding window (keys before it skipped like those past
the position); a prompt with either runs through here too, its queries at the last positions.

The engine's static decode step replays a CUDA graph over a fixed KV bucket with the positions on the
device. torch's SDPA with a boolean mask (ops/attention.masked_attention, the reference) costs about eight
extra kernels a layer for that: the mask build, repeat_interleave, transposes. Here the first kernel masks
from the positions itself and skips the chunks and the blocks of keys past them, so a bucket costs about what
the sequence holds, and everything sized on the host comes from shapes alone: no reads back, the same
launches every step.

The cache may hold another type than q's (-ctk/-ctv, kernels/kv_quant.py): a float dtype, cast as its tiles
load, or llama.cpp's Q8_0/Q4_0 blocks, which each tile dequantizes in registers: no dequantized copy of the
cache is made, and a quantized cache reads a quarter to an eighth of the bytes a bfloat16 one does.
"""

from __future__ import annotations

import math

import torch

from moestream.kernels import kv_quant, tuning
from moestream.kernels.launch import multiprocessors, on_device, pdl, triton

if triton is not None:
    import triton.language as tl

    from moestream.kernels.launch import pdl_start

    @triton.jit
    def _scale(at, ok):
        """The float16 scales at the first two bytes of the blocks at `at`, as float32."""
        lo = tl.load(at, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(at + 1, mask=ok, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _rows(ptr, key, ok, kvh, d, ss, sh, sd, KIND: tl.constexpr, DTYPE: tl.constexpr, DH: tl.constexpr):
        """Cache rows key [BLOCK_S] (those not ok read as 0) of KV head kvh, channels d [DH], as DTYPE. KIND 0:
        a float tensor [S, Hkv, DH] with strides ss, sh, sd; 1 / 2: Q8_0 / Q4_0 blocks [S, bytes] with ss bytes
        a row and sh bytes a head."""
        if KIND == 0:
            x = tl.load(ptr + key[:, None] * ss + kvh * sh + d[None, :] * sd, mask=ok[:, None], other=0).to(DTYPE)
        elif KIND == 1:  # a tile [BLOCK_S, DH / 32 blocks, 32 values]: each block's scale read once
            nb = tl.arange(0, DH // 32)
            at = ptr + key[:, None] * ss + kvh * sh + nb[None, :] * 34  # [BLOCK_S, NB]
            scale = _scale(at, ok[:, None])[:, :, None]
            j = tl.arange(0, 32)[None, None, :]
            q = tl.load(at[:, :, None] + 2 + j, mask=ok[:, None, None], other=0).to(tl.int8, bitcast=True)
            x = tl.reshape((q.to(tl.float32) * scale).to(DTYPE), [key.shape[0], DH])
        else:  # Q4_0 value by value (as a 3-D tile it compiled to more instructions and registers for sm_90)
            at = ptr + key[:, None] * ss + kvh * sh + (d[None, :] // 32) * 18  # each value's block
            j = d[None, :] % 32
            byte = tl.load(at + 2 + j % 16, mask=ok[:, None], other=0).to(tl.int32)
            q = ((byte >> (j // 16 * 4)) & 15).to(tl.float32) - 8  # values 0..15 in the low nibbles, 16..31 high
            x = (q * _scale(at, ok[:, None])).to(DTYPE)
        return x

    @triton.jit
    def _chunk_kernel(
        q,
        k,
        v,
        positions,
        sinks,
        part,
        maxes,
        sums,
        out,
        n_keys,
        window,
        qk_scale,
        sqt,
        sqh,
        sqd,
        sks,
        skh,
        skd,
        svs,
        svh,
        svd,
        HKV: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,  # G as a power of two of at least 16, the smallest tl.dot tile
        DH: tl.constexpr,
        CHUNK: tl.constexpr,
        N_CHUNKS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PRECISION: tl.constexpr,
        SINKS: tl.constexpr,
        PDL: tl.constexpr,
        KIND_K: tl.constexpr = 0,
        KIND_V: tl.constexpr = 0,
    ):
        """One token, one KV head, one chunk of keys: the unnormalised output [G, DH] of its query heads,
        with the running max (log2 units) and sum of the softmax. A chunk past the token's position or
        before its window leaves max -inf, sum 0 and output 0. The only chunk (N_CHUNKS 1) holds every key
        and writes the normalised output itself (sinks included): what the combine would compute, in the
        same float32 operations."""
        pdl_start(PDL)
        t = tl.program_id(0) // HKV
        kvh = tl.program_id(0) % HKV
        c = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, DH)
        real = g < G
        head = kvh * G + g
        lo = c * CHUNK
        pos = tl.load(positions + t)
        hi = tl.minimum(tl.minimum(lo + CHUNK, n_keys), pos + 1)  # keys first..hi-1 count
        first = tl.maximum(lo, pos + 1 - window)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DH], tl.float32)
        if first < hi:  # a block holding a visible key comes first: m_i is finite from it on, no -inf - -inf
            qt = tl.load(q + t * sqt + head[:, None] * sqh + d[None, :] * sqd, mask=real[:, None], other=0)
            for j in range(0, CHUNK, BLOCK_S):  # static bounds (no software pipelining here either way)
                if lo + j < hi and lo + j + BLOCK_S > first:  # a block of unseen keys would add exactly nothing
                    key = lo + j + tl.arange(0, BLOCK_S)
                    ok = (key < hi) & (key >= first)
                    kt = _rows(k, key, ok, kvh, d, sks, skh, skd, KIND_K, qt.dtype, DH)
                    scores = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * qk_scale
                    scores = tl.where(ok[None, :], scores, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(scores - m_new[:, None])
                    vt = _rows(v, key, ok, kvh, d, svs, svh, svd, KIND_V, qt.dtype, DH)
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
                    l_i = l_i * alpha + tl.sum(p, axis=1)
                    m_i = m_new
        if N_CHUNKS == 1:
            r = t * HKV * G + head
            if SINKS:  # the sink's mass joins the sum; it has no value
                sink = tl.load(sinks + head, mask=real, other=0).to(tl.float32) * 1.4426950408889634  # log2 units
                m_new = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha + tl.exp2(sink - m_new)
            tl.store(
                out + r[:, None] * DH + d[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty), mask=real[:, None]
            )
        else:
            row = (t * HKV * G + head) * N_CHUNKS + c
            tl.store(part + row[:, None] * DH + d[None, :], acc, mask=real[:, None])
            tl.store(maxes + row, m_i, mask=real)
            tl.store(sums + row, l_i, mask=real)

    @triton.jit
    def _combine_kernel(
        part,
        maxes,
        sums,
        sinks,
        out,
        H: tl.constexpr,
        DH: tl.constexpr,
        N_CHUNKS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        SINKS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One token and query head: its chunks' outputs weighted by their softmax mass (and the sink's),
        normalised."""
        pdl_start(PDL)
        r = tl.program_id(0)  # t * H + h
        d = tl.arange(0, DH)
        c = tl.arange(0, BLOCK_C)
        m_max = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for c0 in range(0, N_CHUNKS, BLOCK_C):
            m_max = tl.maximum(
                m_max, tl.load(maxes + r * N_CHUNKS + c0 + c, mask=c0 + c < N_CHUNKS, other=float("-inf"))
            )
        m = tl.max(m_max)  # the chunk holding the token's own position saw it: finite
        sink = 0.0
        if SINKS:
            sink = tl.load(sinks + r % H).to(tl.float32) * 1.4426950408889634  # log2 units
            m = tl.maximum(m, sink)
        total = tl.zeros([BLOCK_C], tl.float32)
        acc = tl.zeros([DH], tl.float32)
        for c0 in range(0, N_CHUNKS, BLOCK_C):
            ok = c0 + c < N_CHUNKS
            at = r * N_CHUNKS + c0 + c
            w = tl.exp2(tl.load(maxes + at, mask=ok, other=float("-inf")) - m)  # -inf chunks weigh 0
            total += w * tl.load(sums + at, mask=ok, other=0)
            acc += tl.sum(w[:, None] * tl.load(part + at[:, None] * DH + d[None, :], mask=ok[:, None], other=0), 0)
        norm = tl.sum(total)
        if SINKS:
            norm += tl.exp2(sink - m)
        tl.store(out + r * DH + d, (acc / norm).to(out.dtype.element_ty))


def usable(q: torch.Tensor) -> bool:
    """Whether attention serves queries like q [T, H, Dh]."""
    dh = q.shape[-1]
    return (
        triton is not None
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 16 <= dh <= 256  # 16: the smallest tl.dot extent
        and dh & (dh - 1) == 0
    )


def chunk_size(n_keys: int, n_rows: int, block: int, t: tuning.Tuning) -> int:
    """Keys per chunk for n_keys keys and n_rows (token, KV head) pairs: at least t.attention_min_chunk where
    there are that many, few enough chunks for about t.attention_target_programs programs in all, a multiple
    of block."""
    n_chunks = max(1, min(t.attention_target_programs // n_rows, n_keys // t.attention_min_chunk))
    return triton.cdiv(triton.cdiv(n_keys, n_chunks), block) * block


def chunk_warps(programs: int, device: torch.device, t: tuning.Tuning) -> int:
    """Warps a chunk program for a grid of `programs`: more where each has a multiprocessor to itself."""
    return t.attention_spread_warps if programs <= multiprocessors(device) else t.attention_chunk_warps


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    types: tuple[str | None, str | None] = (None, None),
) -> torch.Tensor:
    """Like ops/attention.masked_attention: softmax attention of q [T, H, Dh] over k, v [S, Hkv, Dh], query t
    seeing keys 0..positions[t] (int64, on q's device), the last `window` of them if nonzero, with the heads'
    sinks [H] in each softmax if given. Returns [T, H, Dh] in q's dtype. types: for k and v, None (a float
    tensor, any dtype) or a quantized type of kernels/kv_quant.py, the tensor then its blocks [S, bytes]."""
    T, H, Dh = q.shape
    S = k.shape[0]
    (k_args, Hkv), (v_args, _) = (_cache_args(c, name, Dh) for c, name in ((k, types[0]), (v, types[1])))
    G = H // Hkv
    t = tuning.current()
    block = min(t.attention_block_keys, 16384 // (Dh * q.element_size()))  # K and V tiles of at most 16 KiB
    # chunks sized for a bucket of keys (a power of two, or a step of one), those past S empty: a prompt's any
    # length compiles few kernels
    step = max(1, triton.next_power_of_2(S) // t.attention_bucket_steps)
    bucket = triton.cdiv(S, step) * step
    chunk = chunk_size(bucket, T * Hkv, block, t)
    n_chunks = triton.cdiv(bucket, chunk)
    out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    if n_chunks == 1:  # the chunk kernel normalises: no partials, no combine
        part, stats = out, (out, out)
    else:
        part = torch.empty((T * H, n_chunks, Dh), dtype=torch.float32, device=q.device)
        stats = torch.empty((2, T * H, n_chunks), dtype=torch.float32, device=q.device)  # running max, sum
    with on_device(q):
        _chunk_kernel[(T * Hkv, n_chunks)](
            q,
            k,
            v,
            positions,
            out if sinks is None else sinks,
            part,
            *stats,
            out,
            S,
            window or S,  # every position below S is within S of the token
            math.log2(math.e) / math.sqrt(Dh),
            *q.stride(),
            *k_args,
            *v_args,
            HKV=Hkv,
            G=G,
            G_PAD=max(16, triton.next_power_of_2(G)),
            DH=Dh,
            CHUNK=chunk,
            N_CHUNKS=n_chunks,
            BLOCK_S=block,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only applies to float32 inputs
            SINKS=sinks is not None,
            KIND_K=kv_quant.KIND.get(types[0], 0),
            KIND_V=kv_quant.KIND.get(types[1], 0),
            num_warps=chunk_warps(T * Hkv * n_chunks, q.device, t),
            **pdl(q),
        )
        if n_chunks > 1:
            _combine_kernel[(T * H,)](
                part,
                *stats,
                out if sinks is None else sinks,
                out,
                H=H,
                DH=Dh,
                N_CHUNKS=n_chunks,
                BLOCK_C=min(t.attention_combine_block, triton.next_power_of_2(n_chunks)),
                SINKS=sinks is not None,
                **pdl(q),
            )
    return out


def _cache_args(cache: torch.Tensor, name: str | None, dh: int) -> tuple[tuple[int, int, int], int]:
    """A cache's strides as the chunk kernel reads them (row, head, channel; bytes for blocks) and its KV heads."""
    if name is None:
        return cache.stride(), cache.shape[1]
    head = dh // kv_quant.BLOCK * kv_quant.BLOCK_BYTES[name]
    return (cache.stride(0), head, 1), cache.shape[1] // head
