"""One decode token of a gated delta-net layer in two kernels: the short convolution, then per value head the
L2 norms, the gates, the delta-rule update of the state and the gated RMSNorm of the output.

The torch form of that token (ops/deltanet.py) is ~60 elementwise kernels a layer, each a few microseconds
inside a CUDA graph: with 30 delta-net layers that, not memory traffic, bounded qwen35moe's decode step. The
state is read and written in place (a captured step replays on the same memory); everything is computed in
float32 and rounded once, so it agrees with the torch form to float32 rounding, not bit for bit (every
schedule on the GPU uses these kernels, so schedules still agree exactly).
"""

from __future__ import annotations

import torch

from moestream.kernels.launch import on_device, pdl, triton

if triton is not None:
    import triton.language as tl

    from moestream.kernels.launch import pdl_start

    @triton.jit
    def _conv_kernel(x, w, conv, y, C, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """y[c] = silu(sum_tap w[c, tap] * (conv_state ++ x)[tap, c]); the state shifts by one input."""
        pdl_start(PDL)
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = c < C
        xc = tl.load(x + c, mask=ok, other=0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for tap in tl.static_range(K - 1):
            past = tl.load(conv + tap * C + c, mask=ok, other=0)
            acc += tl.load(w + c * K + tap, mask=ok, other=0).to(tl.float32) * past
            if tap > 0:
                tl.store(conv + (tap - 1) * C + c, past, mask=ok)
        acc += tl.load(w + c * K + K - 1, mask=ok, other=0).to(tl.float32) * xc
        tl.store(conv + (K - 2) * C + c, xc, mask=ok)
        tl.store(y + c, acc / (1 + tl.exp(-acc)), mask=ok)

    @triton.jit
    def _rule_kernel(
        y, alpha, beta, z, dt_bias, ssm_a, norm, state, out, eps, scale, Hk,
        Dk: tl.constexpr, Dv: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_start(PDL)
        h = tl.program_id(0)  # value head; it reads key head h % Hk (the file tiles value heads over key heads)
        q_at = y + (h % Hk) * Dk  # y = [q of Hk heads | k of Hk heads | v of Hv heads], after the convolution
        k_at = q_at + Hk * Dk
        dk, dv = tl.arange(0, BK), tl.arange(0, BV)
        v_ok = dv < Dv
        q = tl.load(q_at + dk, mask=dk < Dk, other=0)
        k = tl.load(k_at + dk, mask=dk < Dk, other=0)
        q_inv = tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale  # L2 norms, and q's 1/sqrt(Dk)
        k_inv = tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(y + 2 * Hk * Dk + h * Dv + dv, mask=v_ok, other=0)
        a = tl.load(alpha + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1 + tl.exp(tl.minimum(a, 20.0))))  # torch's threshold
        decay = tl.exp(softplus * tl.load(ssm_a + h).to(tl.float32))
        b = 1 / (1 + tl.exp(-tl.load(beta + h).to(tl.float32)))
        # the head's whole state [Dk, Dv] as one tile: read once, decayed and updated in registers, written once
        at = state + h.to(tl.int64) * Dk * Dv + dk[:, None] * Dv + dv[None, :]
        ok = (dk < Dk)[:, None] & v_ok[None, :]
        s_h = tl.load(at, mask=ok, other=0) * decay
        kn = k * k_inv
        delta = b * (v - tl.sum(s_h * kn[:, None], axis=0))
        s_h += kn[:, None] * delta[None, :]
        tl.store(at, s_h, mask=ok)
        o = tl.sum(s_h * (q * q_inv)[:, None], axis=0)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / Dv + eps) * tl.load(norm + dv, mask=v_ok, other=0).to(tl.float32)
        zf = tl.load(z + h * Dv + dv, mask=v_ok, other=0).to(tl.float32)
        tl.store(out + h * Dv + dv, (o * zf / (1 + tl.exp(-zf))).to(out.dtype.element_ty), mask=v_ok)


MAX_STATE_TILE = 128 * 128  # a head's state held in one program's registers (8 warps: 64 floats a thread)


def _tile(d: int) -> int:
    return 1 << max(0, d - 1).bit_length()  # the next power of two (triton.next_power_of_2, without triton)


def _warps(dk: int, dv: int) -> int:
    """Warps for a program holding a head's state: about 64 of its floats a thread (128 x 128: 8 warps)."""
    return max(4, _tile(dk) * _tile(dv) // 2048)


def usable(qkv: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> bool:
    """One token on CUDA with float32 states (a float64 one is a reference: the torch form runs it) and heads
    whose state fits one program's tile."""
    states = (conv_state, recurrent_state)
    return (
        triton is not None
        and qkv.is_cuda
        and qkv.shape[0] == 1
        and conv_state.shape[0] >= 1
        and _tile(recurrent_state.shape[1]) * _tile(recurrent_state.shape[2]) <= MAX_STATE_TILE
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in states)
    )


def decode_step(
    projected: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, ...],
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    k_heads: int,
    eps: float,
) -> torch.Tensor:
    """ops.deltanet.gated_delta_mix for one token on the GPU. projected: qkv [1, C], alpha and beta [1, Hv]
    (before softplus / sigmoid), z [1, Hv * Dv]; weights: the conv weight [C, K], dt_bias, ssm_a, the norm's.
    conv_state [K-1, C] and recurrent_state [Hv, Dk, Dv] (float32) move on in place. Returns the gated,
    normalised output [1, Hv * Dv] in z's dtype."""
    qkv, alpha, beta, z = projected
    conv_weight, dt_bias, ssm_a, norm = weights
    C, K = conv_weight.shape
    Hv, Dk, Dv = recurrent_state.shape
    y = torch.empty(C, dtype=torch.float32, device=qkv.device)
    out = torch.empty(z.shape, dtype=z.dtype, device=z.device)  # the layout the kernel writes
    block = 1024
    with on_device(qkv):
        _conv_kernel[(triton.cdiv(C, block),)](
            qkv.contiguous(), conv_weight.contiguous(), conv_state, y, C, K=K, BLOCK=block, **pdl(y)
        )
        _rule_kernel[(Hv,)](
            y,
            alpha.contiguous(),
            beta.contiguous(),
            z.contiguous(),
            dt_bias,
            ssm_a,
            norm,
            recurrent_state,
            out,
            eps,
            Dk**-0.5,
            k_heads,
            Dk=Dk,
            Dv=Dv,
            BK=_tile(Dk),
            BV=_tile(Dv),
            num_warps=_warps(Dk, Dv),
            **pdl(y),
        )
    return out
