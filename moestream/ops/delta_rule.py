"""The gated delta rule (the recurrence of a delta-net layer), its torch forms and fla's kernel.

Shape legend (one sequence, no batch dimension):
    T   tokens in this call
    H   value heads (q and k already tiled to H by the caller)
    Dk  key/query head dim (GGUF `ssm.state_size`)
    Dv  value head dim
    L   chunk length of the chunked form

Per head and token t, with the state S [Dk, Dv] (float32):
    S <- S * exp(g_t)                     g_t <= 0 is the log decay
    d  = beta_t * (v_t - S^T k_t)         the delta rule: write only what S does not already predict
    S <- S + k_t d^T
    o_t = S^T q_t / sqrt(Dk)

`delta_rule_recurrent` runs that literally (decode); `delta_rule_chunked` computes the same thing with
matmuls within chunks of L tokens and the recurrence only across chunks (prefill). Both take and return
the state, so a prompt split into micro-batches gives the same result as one pass. `delta_rule_fla` is the
chunked form on flash-linear-attention's Triton kernels (optional, CUDA only); `prefill_rule` picks it or
`delta_rule_chunked`, which stays the reference and the fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moestream.errors import MoestreamError
from moestream.options import DELTANET_ENV, deltanet_mode

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
FLA_INSTALL = "pip install flash-linear-attention (or moestream[fla])"


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Cast to the state's dtype (the compute dtype), go head-major, and fold 1/sqrt(Dk) into q.

    Scaling q before use (rather than the output) is what transformers and fla do; the math is the same.
    """
    if state.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"delta-net state must be float32 or float64, got {state.dtype}")
    dtype = state.dtype
    scale = q.shape[-1] ** -0.5
    q, k, v = (t.to(dtype).transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    g, beta = (t.to(dtype).transpose(0, 1) for t in (g, beta))  # [H, T]
    return q * scale, k, v, g, beta


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode, and the reference for the chunked form).

    q, k [T, H, Dk] (L2-normalised, tiled to H), v [T, H, Dv], g [T, H] (log decay, <= 0), beta [T, H],
    state [H, Dk, Dv] float32 (or float64; its dtype is the compute dtype).
    Returns out [T, H, Dv] in v's dtype and the new state; `state` is not modified.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state)
    n_heads, n_tokens, dv = v.shape
    out = v.new_empty(n_tokens, n_heads, dv)
    s = state
    for t in range(n_tokens):
        s = s * g[:, t].exp()[:, None, None]
        predicted = (k[:, t, None, :] @ s).squeeze(1)  # S^T k  [H, Dv]
        delta = beta[:, t, None] * (v[:, t] - predicted)
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[t] = (q[:, t, None, :] @ s).squeeze(1)  # S^T q  [H, Dv]
    return out.to(out_dtype), s


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of L tokens: matmuls within a chunk, recurrence across chunks (prefill).

    Same arguments and result as `delta_rule_recurrent`. Within a chunk, with c_i the cumulative log decay
    from the chunk start to token i and S0 the state entering the chunk, the deltas d_i solve the unit
    lower-triangular system (the UT transform of the WY representation)
        d_i + beta_i * sum_{j<i} exp(c_i - c_j) (k_i.k_j) d_j = beta_i (v_i - exp(c_i) S0^T k_i),
    so D = U - W S0 with U, W from one triangular solve independent of S0. Then
        o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) d_j
        S_end = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j d_j^T.
    Every exponent is <= 0 (future positions are masked before exp), so strong decays cannot overflow.
    A ragged tail is zero-padded with beta = 0 and g = 0, which leaves the state untouched.
    """
    out_dtype = v.dtype
    n_tokens = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state)
    n_heads, _, dk = k.shape
    dv = v.shape[-1]

    pad = (-n_tokens) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n_chunks = (n_tokens + pad) // chunk
    q, k, v = (t.reshape(n_heads, n_chunks, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(n_heads, n_chunks, chunk) for t in (g, beta))

    c = g.cumsum(dim=-1)  # [H, N, L]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay_ij = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf")).exp()  # [H, N, L, L]
    decay_from_start = c.exp()[..., None]  # exp(c_i)        [H, N, L, 1]
    decay_to_end = (c[..., -1:] - c).exp()[..., None]  # exp(c_last - c_j)  [H, N, L, 1]
    chunk_decay = c[..., -1].exp()[..., None, None]  # exp(c_last)  [H, N, 1, 1]

    # The system matrix is I + strictly-lower(beta_i exp(c_i - c_j) k_i.k_j): the solver reads only the strict
    # lower triangle and takes the diagonal as 1.
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay_ij
    rhs = torch.cat([v * beta[..., None], k_beta * decay_from_start], dim=-1)  # [H, N, L, Dv + Dk]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([dv, dk], dim=-1)

    attn = (q @ k.transpose(-1, -2)) * decay_ij  # causal (q_i.k_j) exp(c_i - c_j)  [H, N, L, L]
    q_decayed = q * decay_from_start
    k_to_end = (k * decay_to_end).transpose(-1, -2)  # [H, N, Dk, L]

    out = v.new_empty(n_heads, n_chunks, chunk, dv)
    s = state
    for n in range(n_chunks):
        d = u[:, n] - w[:, n] @ s  # [H, L, Dv]
        out[:, n] = q_decayed[:, n] @ s + attn[:, n] @ d
        s = s * chunk_decay[:, n] + k_to_end[:, n] @ d
    out = out.reshape(n_heads, n_chunks * chunk, dv)[:, :n_tokens]
    return out.transpose(0, 1).to(out_dtype), s


@functools.cache
def _fla_chunk_kernel() -> DeltaRule | None:
    """fla's `chunk_gated_delta_rule`, or None if it cannot be imported (fla, Triton or a driver missing).

    Imported on first use only, never at module import: importing fla pulls in Triton and transformers.
    Any failure to import counts as "not installed", so `auto` falls back to torch silently.
    """
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule_chunked` on flash-linear-attention's `chunk_gated_delta_rule` (Triton, CUDA only).

    Same arguments and result. fla takes q, k [B, T, H, Dk], v [B, T, H, Dv], g and beta [B, T, H] (g the
    log decay, beta after the sigmoid), `scale` applied to q inside, and the state as [N, H, Dk, Dv] float32
    in our orientation (S^T q reads it, k-major); we pass one sequence as B = N = 1. Its GQA ("GVA") maps
    value head h to key head h // (H / Hk), not GGUF's h % Hk, so q and k go in already tiled to H.

    Everything goes in as float32, the state's dtype, like the torch forms: fla keeps its accumulators and
    the state in float32, but Triton runs its matmuls on float32 inputs in TF32 (10-bit mantissa), so it
    agrees with `delta_rule_chunked` to TF32 precision, not to float32 rounding (the bound is fla's own;
    test_deltanet_gpu.py). A float64 state (references only) runs `delta_rule_chunked`: fla has no float64
    kernels.
    """
    if state.dtype != torch.float32:
        return delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    kernel = _fla_chunk_kernel()
    if kernel is None:
        raise MoestreamError(f"the fla delta rule needs flash-linear-attention: {FLA_INSTALL}")
    out, new_state = kernel(
        *(t.to(torch.float32)[None] for t in (q, k, v, g, beta)),
        scale=q.shape[-1] ** -0.5,
        initial_state=state[None],
        output_final_state=True,
        chunk_size=chunk,
    )
    return out[0].to(v.dtype), new_state[0]


def prefill_rule(mode: str, device: torch.device | str) -> DeltaRule:
    """The delta rule for prefill (T > 1) on `device` in `mode` ($MOESTREAM_DELTANET, read with the options).

    auto (default): `delta_rule_fla` on CUDA when fla imports, else `delta_rule_chunked`; torch: always
    `delta_rule_chunked`; fla: `delta_rule_fla`, and an error if the device is not CUDA or fla is missing.
    """
    mode = deltanet_mode(mode)
    if mode == "torch":
        return delta_rule_chunked
    on_cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        return delta_rule_fla if on_cuda and _fla_chunk_kernel() is not None else delta_rule_chunked
    if not on_cuda:
        raise MoestreamError(f"{DELTANET_ENV}=fla: fla's kernels run on CUDA only, not on {device}")
    if _fla_chunk_kernel() is None:
        raise MoestreamError(f"{DELTANET_ENV}=fla: flash-linear-attention is not installed: {FLA_INSTALL}")
    return delta_rule_fla
