"""Layer primitives shared by every architecture: plain tensor math, no devices or streams.

Legend: T = tokens in the micro-batch, S = positions in the KV cache so far, D = hidden size,
H / Hkv = query / key-value heads, Dh = head dim, E = experts, K = experts used per token, F = expert FFN size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from moestream.kernels import decode_attention, fused, matvec
from moestream.kernels.grouped_moe import grouped_mm


class Cache(Protocol):
    """A sequence's state between passes: `kv.update(il, pos0, k, v)` for attention layers and
    `recurrent[il]` for layers that carry a state (delta-net). A batch with `rows` comes with a list of
    caches instead, one per row."""

    kv: Any
    recurrent: dict[int, Any]


@dataclass(frozen=True)
class Batch:
    """What every layer needs to know about the micro-batch: where it starts and its rotary tables.

    A static batch (n_keys set) is one whose shapes and host values do not change from step to step, so a
    captured CUDA graph can replay it: the positions live only on the device, the KV cache is written at
    them and attention reads the first n_keys cache rows, masking those past each token's position.
    """

    pos0: int  # first position (dynamic batches; -1 in a static one, where the host does not know it)
    cos: torch.Tensor  # [T, rot_dim/2]
    sin: torch.Tensor
    positions: torch.Tensor  # [T] int64 on the compute device
    n_keys: int | None = None  # static batches: cache rows attention reads
    rows: tuple[Batch, ...] = ()  # one token of each of several sequences: each row's own static batch


HEAD_ROWS = 32768
"""Output-head rows dequantized at once: the whole head of a 248k vocabulary in bf16 would be ~1 GiB."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, over the last dim."""
    if fused.usable(x) and weight.dtype == x.dtype:  # one kernel instead of seven (decode is launch-bound)
        return fused.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x + r: a layer's residual add and the norm in front of its MoE block."""
    if fused.usable(x) and x.dtype == r.dtype == weight.dtype:  # one kernel for both
        return fused.add_rms_norm(x, r, weight, eps)
    h = x + r
    return h, rms_norm(h, weight, eps)


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, base: float, dtype: torch.dtype):
    """cos, sin [T, rot_dim/2] for NEOX-style rotation of the first rot_dim channels."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.float32) / rot_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def imrope_text_cos_sin(
    positions: torch.Tensor, rot_dim: int, base: float, sections: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rot_dim/2] of interleaved multi-section RoPE (llama.cpp's imrope) for text tokens.

    Pair i belongs to section i % 3 (time, height, width) while i < 3 * sections[i % 3], otherwise to the 4th
    section. Text gives the first three the token's position and the 4th position 0: those pairs do not turn.
    """
    cos, sin = rope_cos_sin(positions, rot_dim, base, dtype)
    pair = torch.arange(rot_dim // 2, device=positions.device)
    section = pair % 3
    limit = torch.where(section == 0, 3 * sections[0], torch.where(section == 1, 3 * sections[1], 3 * sections[2]))
    text = pair < limit  # built from scalars: no host-to-device copy, so a CUDA graph can capture it
    return torch.where(text, cos, 1.0), torch.where(text, sin, 0.0)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2*cos.shape[-1] channels of x [T, H, Dh]; the rest pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """rope_neox(rms_norm(x, weight, eps), cos, sin) for x [T, H, Dh]: q and k before attention."""
    if fused.usable(x) and weight.dtype == x.dtype == cos.dtype:
        return fused.rms_norm(x, weight, eps, cos.contiguous(), sin.contiguous())
    return rope_neox(rms_norm(x, weight, eps), cos, sin)


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    batch: Batch,
    caches: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A static batch's attention prologue: q and k [T, H|Hkv, Dh] through rms_norm_rope by their norms, k and
    v stored at the batch's device positions in caches (k, v [S, Hkv, Dh]). Returns q."""
    if fused.usable(q) and all(t.dtype == q.dtype for t in (k, v, *norms, batch.cos, *caches)):  # one launch
        return fused.qkv_store(q, k, v, norms, eps, (batch.cos, batch.sin), caches, batch.positions)
    q = rms_norm_rope(q, norms[0], eps, batch.cos, batch.sin)
    caches[0].index_copy_(0, batch.positions, rms_norm_rope(k, norms[1], eps, batch.cos, batch.sin))
    caches[1].index_copy_(0, batch.positions, v)
    return q


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [T, H, Dh] (the last T positions) over k, v [S, Hkv, Dh] (positions 0..S-1).

    The causal mask is aligned to the bottom right (query i sees keys up to S - T + i), passed as a bias
    object rather than a dense mask so SDPA can pick its flash / memory-efficient kernels.
    """
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    if Hkv != H:  # GQA: query head h reads KV head h // (H / Hkv)
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T|S, Dh]: 4-D, as flash needs
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
    return out[0].transpose(0, 1)  # [T, H, Dh]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [T, H, Dh] over k, v [S, Hkv, Dh], query t seeing keys 0..positions[t].

    For static batches (decode steps replayed from a graph): S is fixed and the mask comes from device
    positions. On a GPU kernels/decode_attention.py does it in one or two launches; elsewhere SDPA with a boolean
    mask, the query heads sharing a KV head going in as rows of one group, so K and V are read once.
    """
    if decode_attention.usable(q):  # one or two launches, masking from the positions itself
        return decode_attention.attention(q, k, v, positions)
    T, H, Dh = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    rows = q.view(T, Hkv, G, Dh).transpose(0, 1).reshape(1, Hkv, T * G, Dh)  # row t*G+g: token t, head h*G+g
    visible = torch.arange(S, device=q.device)[None, :] <= positions[:, None]  # [T, S]
    mask = visible.repeat_interleave(G, dim=0)[None, None]  # [1, 1, T*G, S]
    out = F.scaled_dot_product_attention(rows, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask)
    return out[0].view(Hkv, T, G, Dh).transpose(0, 1).reshape(T, H, Dh)


def route_softmax_topk(x: torch.Tensor, w_router: torch.Tensor, k: int, renorm: bool = True):
    """Softmax over all experts, top-k, chosen weights renormalised to sum 1. Returns weights [T, K], ids [T, K]."""
    logits = matvec.linear_each_row(x, w_router)  # a decode batch's rows route as each would alone
    return softmax_topk(logits, k, x.dtype, renorm)


def softmax_topk(logits: torch.Tensor, k: int, dtype: torch.dtype, renorm: bool = True):
    """route_softmax_topk from the router's logits [T, E]: weights [T, K] in dtype, ids [T, K]."""
    if fused.usable(logits):  # softmax, top-k and renormalisation in one kernel
        return fused.softmax_topk(logits, k, renorm, dtype)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


Stack = torch.Tensor | Callable[[], torch.Tensor]


def expert_counts(ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """Token-expert pairs per expert. Not torch.bincount: on CUDA it reads the max id back to the host."""
    return torch.zeros(n_expert, dtype=torch.int32, device=ids.device).index_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int32)
    )


def moe_swiglu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    n_expert: int,
    w_gate: Stack,
    w_up: Stack,
    w_down: Stack,
) -> torch.Tensor:
    """Sum over chosen experts of weight * down(silu(gate(x)) * up(x)), as one grouped computation.

    x [T, D]; weights, ids [T, K] (ids index the stacks); w_gate, w_up [E, F, D]; w_down [E, D, F], each
    a tensor or a function making it, called just before use so only one dequantized stack is alive.
    Deterministic: no atomics, so equal inputs give equal bits whatever the schedule.
    """
    return moe_swiglu_sharded(x, weights, ids, [(0, n_expert, (w_gate, w_up, w_down))])


def moe_swiglu_sharded(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shards: Sequence[tuple[int, int, tuple[Stack, Stack, Stack]]],
) -> torch.Tensor:
    """moe_swiglu with the experts split into consecutive id ranges (lo, hi, (gate, up, down) of experts
    lo..hi-1), each range's stacks on its own device: the rows routed to a range go there and their products
    come back. Each token-expert pair is computed exactly once, as in one device, so results are the same."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert
    rows = x[order // K]  # [T*K, D]
    ends = expert_counts(flat, shards[-1][1]).cumsum(0)
    # where each range's pairs end among the sorted ones: a host sync, only with more than one device
    before = F.pad(ends, (1, 0)).tolist() if len(shards) > 1 else None  # pairs routed below expert e
    cuts = [before[hi] for _, hi, _ in shards[:-1]] + [T * K] if before else [T * K]
    y_sorted = torch.empty_like(rows)
    start = 0
    for (lo, hi, (w_gate, w_up, w_down)), end in zip(shards, cuts, strict=True):
        if end == start:
            continue
        gate = w_gate() if callable(w_gate) else w_gate
        part = rows[start:end].to(gate.device)
        offs = (ends[lo:hi] - start).to(device=gate.device, dtype=torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor, offs=offs) -> torch.Tensor:
            return grouped_mm(a, w.transpose(1, 2), offs)

        h = F.silu(mm(part, gate))
        del gate
        h = h * mm(part, w_up() if callable(w_up) else w_up)
        y_sorted[start:end] = mm(h, w_down() if callable(w_down) else w_down).to(x.device)
        start = end
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return (y.view(T, K, -1) * weights[..., None]).sum(dim=1)


MatVec = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(which [P] matrix of a stack, rows [P, in]) -> [P, out]: each row times its own matrix."""


def moe_swiglu_picked(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: MatVec, up: MatVec, down: MatVec
):
    """moe_swiglu for a few tokens: each token-expert pair multiplies its expert's matrices directly, with no
    grouping (the kernels read the chosen experts' blocks wherever they lie)."""
    T, K = ids.shape
    picks = ids.reshape(-1)  # pair t*K+k: token t, its k-th expert
    rows = x.repeat_interleave(K, dim=0)
    h = F.silu(gate(picks, rows)) * up(picks, rows)
    return (down(picks, h).view(T, K, -1) * weights[..., None]).sum(dim=1)
