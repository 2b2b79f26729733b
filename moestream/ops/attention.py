"""Softmax attention over the KV cache: a prompt's tokens through SDPA with a causal bias, a static (decode)
batch through the decode attention kernel on a GPU, and that batch's prologue (q/k norm, RoPE, the cache
writes) in one launch.

Legend: T = tokens, S = positions in the KV cache, H / Hkv = query / key-value heads, Dh = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels import decode_attention, fused
from moestream.ops.rope import rms_norm_rope


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """A static batch's attention prologue: q and k [T, H|Hkv, Dh] through rms_norm_rope by their norms and
    the rope tables (cos, sin [T, rot_dim/2]), k and v stored in caches (k, v [S, Hkv, Dh]) at the device
    positions [T]. Returns q."""
    cos, sin = rope
    if fused.usable(q) and all(t.dtype == q.dtype for t in (k, v, *norms, cos, *caches)):  # one launch
        return fused.qkv_store(q, k, v, norms, eps, rope, caches, positions)
    q = rms_norm_rope(q, norms[0], eps, cos, sin)
    caches[0].index_copy_(0, positions, rms_norm_rope(k, norms[1], eps, cos, sin))
    caches[1].index_copy_(0, positions, v)
    return q


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [T, H, Dh] (the last T positions) over k, v [S, Hkv, Dh] (positions 0..S-1).

    The causal mask is aligned to the bottom right (query i sees keys up to S - T + i): SDPA's own causal flag
    when T == S, flash attention's (which aligns so) on a GPU, else a dense mask. Not torch's causal_lower_right:
    its module imports torch._dynamo, seconds of start-up for every command.
    """
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    if Hkv != H:  # GQA: query head h reads KV head h // (H / Hkv)
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T|S, Dh]: 4-D, as flash needs
    if T == S:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif (
        q.is_cuda
        and q.shape[-1] % 8 == 0
        and torch.backends.cuda.can_use_flash_attention(
            torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
        )
    ):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True)[0]
    else:
        visible = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
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
