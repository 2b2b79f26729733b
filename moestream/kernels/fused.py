"""Fused small-op kernels for the per-token work of a layer: RMSNorm (with the rotary embedding of q and k
folded in, and for a decode step the KV cache write too) and the router's softmax + top-k + renormalisation.

A decode step replays a CUDA graph of every layer; there each torch elementwise op is its own kernel of a few
microseconds, and one token's RMSNorm alone was seven of them. Per layer that came to ~85 kernels, which is
what bounded the step, not memory traffic. These do each job in one launch, computing in float32 and rounding
once where torch rounds after every op (so they agree with the torch path to bf16 rounding, not bit for bit;
every schedule on the GPU uses the same kernels, so schedules still agree exactly).
"""

from __future__ import annotations

import torch

from moestream.kernels.launch import on_device, pdl, triton

if triton is not None:
    import triton.language as tl

    from moestream.kernels.launch import pdl_start

    @triton.jit
    def _norm_row(x, w, y, cos, sin, eps, D: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr):
        """RMSNorm of the D values at x (rounded as torch rounds: normed, then times w), then NEOX RoPE by the
        HALF values at cos, sin when ROPE; stored at y."""
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        xf = tl.load(x + offs, mask=ok, other=0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        wf = tl.load(w + offs, mask=ok, other=0).to(tl.float32)
        v = (wf * (xf * r).to(y.dtype.element_ty).to(tl.float32)).to(y.dtype.element_ty).to(tl.float32)
        if ROPE:  # NEOX: channel j < HALF pairs with j + HALF; channels from 2 * HALF on pass through
            first = offs < HALF
            turns = offs < 2 * HALF
            mate = tl.where(first, offs + HALF, tl.where(turns, offs - HALF, offs))
            xm = tl.load(x + mate, mask=ok, other=0).to(tl.float32)
            wm = tl.load(w + mate, mask=ok, other=0).to(tl.float32)
            vm = (wm * (xm * r).to(y.dtype.element_ty).to(tl.float32)).to(y.dtype.element_ty).to(tl.float32)
            at = tl.where(first, offs, offs - HALF)
            c = tl.where(turns, tl.load(cos + at, mask=ok & turns).to(tl.float32), 1.0)
            s = tl.where(turns, tl.load(sin + at, mask=ok & turns).to(tl.float32), 0.0)
            v = v * c + tl.where(first, -vm, vm) * s
        tl.store(y + offs, v.to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _biased(x, b, offs, ok, BIAS: tl.constexpr, dtype: tl.constexpr):
        """x + b at offs in float32, rounded to dtype as torch's add rounds (x alone without BIAS)."""
        v = tl.load(x + offs, mask=ok, other=0).to(tl.float32)
        if BIAS:
            v = (v + tl.load(b + offs, mask=ok, other=0).to(tl.float32)).to(dtype).to(tl.float32)
        return v

    @triton.jit
    def _rope_row(x, b, y, cos, sin, D: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, BIAS: tl.constexpr):
        """NEOX RoPE of the D values at x (plus the bias at b with BIAS) by the HALF values at cos, sin (heads
        without a norm), stored at y."""
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        first = offs < HALF
        turns = offs < 2 * HALF
        mate = tl.where(first, offs + HALF, tl.where(turns, offs - HALF, offs))
        v = _biased(x, b, offs, ok, BIAS, y.dtype.element_ty)
        vm = _biased(x, b, mate, ok, BIAS, y.dtype.element_ty)
        at = tl.where(first, offs, offs - HALF)
        c = tl.where(turns, tl.load(cos + at, mask=ok & turns).to(tl.float32), 1.0)
        s = tl.where(turns, tl.load(sin + at, mask=ok & turns).to(tl.float32), 0.0)
        tl.store(y + offs, (v * c + tl.where(first, -vm, vm) * s).to(y.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_norm_kernel(
        x,
        w,
        y,
        cos,
        sin,
        n_heads,
        eps,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        HALF: tl.constexpr,
        ROPE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)  # one row of D (a token, or a token's head)
        t = row // n_heads
        _norm_row(x + row * D, w, y + row * D, cos + t * HALF, sin + t * HALF, eps, D, BLOCK, HALF, ROPE)

    @triton.jit
    def _add_rms_norm_kernel(
        x, r, b, w, h, y, eps, D: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr
    ):
        """h = x + r (rounded as torch's add; with BIAS, r + b first, rounded too), y = RMSNorm(h): a layer's
        residual add and the norm after it."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        mixed = tl.load(r + row * D + offs, mask=ok)
        if BIAS:
            mixed = (mixed.to(tl.float32) + tl.load(b + offs, mask=ok).to(tl.float32)).to(h.dtype.element_ty)
        total = tl.load(x + row * D + offs, mask=ok).to(tl.float32) + mixed.to(tl.float32)
        tl.store(h + row * D + offs, total.to(h.dtype.element_ty), mask=ok)
        tl.debug_barrier()  # the row's sum is read back below by other threads of the program
        _norm_row(h + row * D, w, y + row * D, h, h, eps, D, BLOCK, 1, False)

    @triton.jit
    def _qkv_store_kernel(
        q,
        k,
        v,
        wq,
        wk,
        bq,
        bk,
        bv,
        q_out,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        H,
        HKV,
        eps,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program a head of token t: q heads normed (NORM) and turned into q_out, k heads normed and turned
        into the cache row at positions[t], v heads copied there; with BIAS (no NORM), each head's bias added
        first."""
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64) // (H + 2 * HKV)
        head = tl.program_id(0).to(tl.int64) % (H + 2 * HKV)
        at = tl.load(positions + t).to(tl.int64)
        if head < H:
            i = t * H + head
            if NORM:
                _norm_row(q + i * D, wq, q_out + i * D, cos + t * HALF, sin + t * HALF, eps, D, BLOCK, HALF, True)
            else:
                _rope_row(q + i * D, bq + head * D, q_out + i * D, cos + t * HALF, sin + t * HALF, D, BLOCK, HALF, BIAS)
        elif head < H + HKV:
            i = head - H
            dst = k_cache + (at * HKV + i) * D
            if NORM:
                _norm_row(k + (t * HKV + i) * D, wk, dst, cos + t * HALF, sin + t * HALF, eps, D, BLOCK, HALF, True)
            else:
                _rope_row(k + (t * HKV + i) * D, bk + i * D, dst, cos + t * HALF, sin + t * HALF, D, BLOCK, HALF, BIAS)
        else:
            i = head - H - HKV
            offs = tl.arange(0, BLOCK)
            ok = offs < D
            row = _biased(v + (t * HKV + i) * D, bv + i * D, offs, ok, BIAS, v_cache.dtype.element_ty)
            tl.store(v_cache + (at * HKV + i) * D + offs, row.to(v_cache.dtype.element_ty), mask=ok)

    @triton.jit
    def _softmax_topk_kernel(
        logits,
        bias,
        w_out,
        id_out,
        E,
        K: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_E: tl.constexpr,
        RENORM: tl.constexpr,
        BIAS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        z = tl.load(logits + t * E + offs, mask=ok, other=-float("inf"))
        if BIAS:  # the router's bias, the sum rounded to the logits' dtype as torch's add would
            z = (z.to(tl.float32) + tl.load(bias + offs, mask=ok, other=0.0).to(tl.float32)).to(z.dtype)
        z = z.to(tl.float32)
        e = tl.where(ok, tl.exp(z - tl.max(z, axis=0)), 0.0)
        p = e / tl.sum(e, axis=0)
        # past E, and each expert once taken: -inf. A NaN (an overflowed logit, a broken weight) ranks lowest of
        # the real experts, so every id chosen names an expert (torch.topk's guarantee; the ids index weights)
        p = tl.where(ok, tl.where(p == p, p, -1.0), -float("inf"))
        slot = tl.arange(0, KP)
        chosen_w = tl.zeros([KP], dtype=tl.float32)
        chosen_id = tl.zeros([KP], dtype=tl.int64)
        for k in tl.static_range(K):  # K rounds of argmax (lowest index among equals)
            best = tl.max(p, axis=0)
            idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), axis=0), E - 1)
            chosen_w = tl.where(slot == k, best, chosen_w)
            chosen_id = tl.where(slot == k, idx.to(tl.int64), chosen_id)
            p = tl.where(offs == idx, -float("inf"), p)
        if RENORM:
            chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
        tl.store(w_out + t * K + slot, chosen_w.to(w_out.dtype.element_ty), mask=slot < K)
        tl.store(id_out + t * K + slot, chosen_id, mask=slot < K)


def usable(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D]; with cos, sin [T, half] (x [T, H, D]) NEOX RoPE on the result."""
    D = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // D
    rope = cos is not None
    if rows:
        with on_device(x):
            _rms_norm_kernel[(rows,)](
                x,
                weight,
                y,
                cos if rope else x,  # unread without ROPE
                sin if rope else x,
                x.shape[-2] if rope else 1,
                eps,
                HALF=cos.shape[-1] if rope else 1,
                ROPE=rope,
                **_row_tile(D),
                **pdl(x),
            )
    return y


def _row_tile(D: int) -> dict:
    """The row kernels' launch shape for rows of D values: one tile of the whole row, 8 warps past 1024."""
    return dict(D=D, BLOCK=triton.next_power_of_2(D), num_warps=4 if D <= 1024 else 8)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm of it) for rows x, r [T, D] in one launch; with bias [D], x + (r + bias)."""
    x, r = x.contiguous(), r.contiguous()
    h, y = torch.empty_like(x), torch.empty_like(x)
    D = x.shape[-1]
    if x.numel():
        with on_device(x):
            b = bias if bias is not None else x  # unread without BIAS
            _add_rms_norm_kernel[(x.numel() // D,)](
                x, r, b, weight, h, y, eps, **_row_tile(D), BIAS=bias is not None, **pdl(x)
            )
    return h, y


def qkv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q, k [T, H|Hkv, Dh] each RMSNormed by norms (None: heads without norms, gpt-oss) and NEOX-turned by rope
    (cos, sin [T, half]); k and v [T, Hkv, Dh] stored at rows positions [T] of caches (k, v [S, Hkv, Dh]).
    Returns q. One launch for the four ops of a decode step's attention prologue, with the bits of rms_norm
    with RoPE and index_copy_ (without norms: RoPE in float32, rounded once). Without norms, biases (q, k, v:
    [H*Dh], [Hkv*Dh] each) are added first, rounded as torch adds them."""
    if biases is not None and norms is not None:
        raise ValueError("qkv_store adds biases only to heads without norms")
    T, H, D = q.shape
    Hkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    cos, sin = (t.contiguous() for t in rope)
    if T:
        with on_device(q):
            _qkv_store_kernel[(T * (H + 2 * Hkv),)](
                q,
                k,
                v,
                *(norms or (q, q)),  # unread without norms
                *(biases or (q, q, q)),  # unread without biases
                out,
                *caches,
                cos,
                sin,
                positions,
                H,
                Hkv,
                eps,
                HALF=cos.shape[-1],
                NORM=norms is not None,
                BIAS=biases is not None,
                **_row_tile(D),
                **pdl(q),
            )
    return out


def softmax_topk(
    logits: torch.Tensor, k: int, renorm: bool, dtype: torch.dtype, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of logits [T, E] (plus bias [E], added in their dtype) in float32, the k largest
    (weights in dtype, ids int64), weights renormalised to sum 1 when renorm."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty((T, k), dtype=dtype, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        with on_device(logits):
            _softmax_topk_kernel[(T,)](
                logits,
                bias if bias is not None else logits,  # unread without BIAS
                weights,
                ids,
                E,
                K=k,
                KP=triton.next_power_of_2(k),
                BLOCK_E=triton.next_power_of_2(E),
                RENORM=renorm,
                BIAS=bias is not None,
                num_warps=1 if E <= 256 else 4,  # one warp: the 2 k + 2 reductions are shuffles, no shared memory
                **pdl(logits),
            )
    return weights, ids
