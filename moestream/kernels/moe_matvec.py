"""The routed experts of a few tokens (decode) from their stored blocks: gate, up and SiLU of every picked
token-expert pair in one launch, the pairs' down products through kernels/matvec.py, then each token's
weighted sum (with the residual and a shared expert) in one more. The shared expert's dense gate and up pair
goes through the same gate-and-up kernel. gpt-oss's experts fit the same launches: their gate, up and down
biases (per pair) and clamped GLU go into the gate-and-up and sum kernels.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from moestream.kernels import tuning
from moestream.kernels.dequant import table_args
from moestream.kernels.dots import DOTS
from moestream.kernels.launch import on_device, pdl, triton
from moestream.kernels.matvec import aligned_x, check_aligned, fewest_programs, layout, matvec, tile

if triton is not None:
    import triton.language as tl

    from moestream.kernels.launch import pdl_start
    from moestream.kernels.matvec import row_dot

    @triton.jit
    def _gate_up_kernel(
        wg,
        wu,
        x,
        h,
        mats,
        gate_bias,
        up_bias,
        bias_rows,
        n_out,
        row_bytes,
        K,
        alpha,
        limit,
        table,
        N_BLOCKS: tl.constexpr,
        DOT: tl.constexpr,
        TABLE: tl.constexpr,
        ELEMS: tl.constexpr,
        SIZE: tl.constexpr,
        STACKED: tl.constexpr,
        ROWS: tl.constexpr,
        B: tl.constexpr,
        UNROLLED: tl.constexpr,
        CLAMPED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """h[p] = silu(gate_p x[p // K]) * (up_p x[p // K]) for token-expert pair p (STACKED; a dense gate
        and up pair: p is the token, K 1): one read of x, no copies. CLAMPED: gpt-oss's, g * sigmoid(alpha g)
        * (u + 1) of g = min(gate + bias, limit), u = clamp(up + bias, -limit, limit), pair p's biases [n_out]
        bias_rows elements after pair p - 1's."""
        pdl_start(PDL)
        p = tl.program_id(1).to(tl.int64)
        out = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ok = (out < n_out)[:, None]
        mat = tl.load(mats + p).to(tl.int64) if STACKED else 0
        xp = x + (p // K) * N_BLOCKS * ELEMS
        g, u = row_dot(
            wg, wu, mat, out, n_out, row_bytes, xp, ok, table, N_BLOCKS, DOT, TABLE, ELEMS, SIZE, B, UNROLLED, True
        )
        if CLAMPED:
            at = p * bias_rows + out
            g = tl.minimum(g + tl.load(gate_bias + at, mask=out < n_out, other=0).to(tl.float32), limit)
            u = u + tl.load(up_bias + at, mask=out < n_out, other=0).to(tl.float32)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            y = g / (1 + tl.exp(-alpha * g)) * (u + 1)
        else:
            y = g / (1 + tl.exp(-g)) * u
        tl.store(h + p * n_out + out, y.to(h.dtype.element_ty), mask=out < n_out)

    @triton.jit
    def _weighted_sum_kernel(
        down, w, res, shared, gate, down_bias, bias_rows, out, D,
        K: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, SHARED: tl.constexpr, BIAS: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """out[t] = sum over k in order of w[t, k] down[t K + k] (with BIAS, w[t, k] (down + down_bias)[t K + k],
        the bias per pair, bias_rows elements apart), in float32: one token's sum, the same bits
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
            y = tl.load(down + (t * K + k) * D + cols, mask=ok, other=0).to(tl.float32)
            if BIAS:
                y += tl.load(down_bias + (t * K + k) * bias_rows + cols, mask=ok, other=0).to(tl.float32)
            acc += wk * y
        s = acc.to(out.dtype.element_ty)
        if SHARED:
            g = tl.sigmoid(tl.load(gate + t).to(tl.float32)).to(s.dtype)
            scaled = (g.to(tl.float32) * tl.load(shared + t * D + cols, mask=ok, other=0).to(tl.float32)).to(s.dtype)
            s = (s.to(tl.float32) + scaled.to(tl.float32)).to(s.dtype)
        if RESIDUAL:
            s = (tl.load(res + t * D + cols, mask=ok, other=0).to(tl.float32) + s.to(tl.float32)).to(s.dtype)
        tl.store(out + t * D + cols, s, mask=ok)


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
    clamped: tuple | None = None,
) -> torch.Tensor:
    """h [P, n_ff] = silu(gate x) * (up x) for each pair p: the gate and up matrices picks[p] of the stacks
    (picks None: one matrix each), times x[p // K]; clamped (gate bias, up bias [P, n_ff], _, alpha, limit):
    gpt-oss's GLU instead."""
    t = tuning.current()
    D = x.shape[-1]
    x = aligned_x(x)
    P = x.shape[0] * K
    h = torch.empty((P, n_ff), dtype=x.dtype, device=x.device)
    gate_row, gate_consts = layout(qtypes[0], D, raws[0], t.gate_up_blocks_at_once, t.float_blocks_at_once)
    check_aligned(qtypes[1], raws[1])  # up is stored like gate (fuses)
    rows, warps = tile(t.rows_per_program, t.gate_up_warps, n_ff, K, fewest_programs(x.device, t))  # see matvec
    with on_device(x):
        _gate_up_kernel[(triton.cdiv(n_ff, rows), P)](
            raws[0],
            raws[1],
            x,
            h,
            x if picks is None else picks,  # unread without picks
            *((x, x, 0) if clamped is None else _rows(*clamped[:2])),  # unread without clamped
            n_ff,
            gate_row,
            K,
            0.0 if clamped is None else clamped[3],
            0.0 if clamped is None else clamped[4],
            **table_args(qtypes[0], x),
            STACKED=picks is not None,
            CLAMPED=clamped is not None,
            ROWS=rows,
            UNROLLED=t.unrolled,
            num_warps=warps,
            **gate_consts,
            **pdl(x),
        )
    return h


def _rows(*biases: torch.Tensor) -> tuple:
    """The per-pair bias tensors as the kernels read them, then the elements from one pair's row to the next:
    views of one gathered table as they are (rows of unit stride, the same step), anything else made so."""
    if any(b.stride(-1) != 1 or b.stride(0) != biases[0].stride(0) for b in biases):
        biases = tuple(b.contiguous() for b in biases)
    return (*biases, biases[0].stride(0))


def swiglu_picked(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    raws: list[torch.Tensor],
    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType],
    n_ff: int,
    residual: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    clamped: tuple | None = None,
) -> torch.Tensor:
    """ops.moe_swiglu.moe_swiglu_picked in three launches: gate, up and SiLU of every token-expert pair in one,
    each pair's down product in the next (faster than one kernel looping over a token's experts), then the
    weighted sum over each token's experts. Each pair's down
    product is rounded to x's dtype before the sum, as in the torch form. Nothing in it depends on the other
    tokens of the batch (see matvec). x [T, D]; weights, ids [T, K]; raws the gate, up, down stacks' stored
    bytes (device or page-locked host memory), by ids. shared (out [T, D], gate logit [T, 1]) and residual
    [T, D], if given, are added in the sum's launch, as ops.experts.routed_swiglu adds them (see there).
    clamped (gate, up, down biases [T*K, F|D] per pair, alpha, limit: ops.moe_swiglu.ClampedGlu's fields):
    gpt-oss's experts."""
    T, K = ids.shape
    D = x.shape[-1]
    like = (
        ("residual", residual, x.shape),
        ("shared", shared and shared[0], x.shape),
        ("shared gate", shared and shared[1], (T, 1)),
    )
    if clamped is not None:
        biases = zip(("gate bias", "up bias", "down bias"), clamped[:3], (n_ff, n_ff, D), strict=True)
        like += tuple((name, b, (T * K, n)) for name, b, n in biases)
    for name, t, shape in like:  # a broadcast one would be read past its end
        if t is not None and (t.shape != shape or t.dtype != x.dtype):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} is not like x: {tuple(shape)} {x.dtype}")
    picks = ids.reshape(-1).contiguous()
    h = _gate_up(x, raws, qtypes, n_ff, picks, K, clamped)
    down = matvec(raws[2], qtypes[2], D, h, picks, K)  # [T*K, D]: each pair's own programs, a wide grid
    out = torch.empty_like(x)
    sum_block = tuning.current().sum_block
    with on_device(x):
        _weighted_sum_kernel[(T, triton.cdiv(D, sum_block))](
            down,
            weights.contiguous(),
            out if residual is None else residual.contiguous(),  # unread without a residual
            out if shared is None else shared[0].contiguous(),  # unread without a shared expert
            out if shared is None else shared[1].contiguous(),
            *((out, 0) if clamped is None else _rows(clamped[2])),  # unread without clamped
            out,
            D,
            K=K,
            BLOCK=sum_block,
            RESIDUAL=residual is not None,
            SHARED=shared is not None,
            BIAS=clamped is not None,
            num_warps=4,
            **pdl(x),
        )
    return out


def fuses(qtypes) -> bool:
    """Whether swiglu_picked serves experts of these (gate, up, down) types: gate and up stored alike."""
    g, u, d = qtypes
    return g == u and g in DOTS and d in DOTS
