"""A prompt's causal attention deep in a context: the cached prefix, then the micro-batch's own keys under the
causal mask, each piece's softmax merged into the running one by its log-sum-exp (flash attention's online
softmax, one level up), so a micro-batch's temporaries are the same at depth 100k as at depth 0 and the VRAM budget
can count them. Where the kernel reads the key-value heads itself (flash attention on a GPU) the prefix is one
piece, read in place; elsewhere its keys are repeated to every query head a chunk of a fixed number of keys at a
time.

Legend: T = the micro-batch's tokens (the last T positions of the cache), S = positions in the cache, C = keys of
a chunk, H / Hkv = query / key-value heads, Dh = head dim.
"""

from __future__ import annotations

import torch

KEY_CHUNK = 4096
"""Prefix keys a chunk reads: the temporaries of one chunk (its keys and values repeated to every query head) are
bounded by it, not by the depth."""


def in_chunks(T: int, S: int, key_chunk: int = KEY_CHUNK) -> bool:
    """Whether T queries over S keys go in chunks: only when one pass would read more than a chunk besides the
    micro-batch's own keys (shorter ones keep the one fused call, and its bits)."""
    return S - T > key_chunk


def attention_keys(n_ctx: int, ubatch: int, key_chunk: int = KEY_CHUNK) -> int:
    """The most keys one attention call of a micro-batch reads at once (offload/placement.py budgets them)."""
    return min(n_ctx, ubatch + key_chunk)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_chunk: int = KEY_CHUNK) -> torch.Tensor:
    """Causal softmax attention of q [T, H, Dh] (the last T positions) over k, v [S, Hkv, Dh]: the prefix
    (positions 0..S-T-1, seen by every query) whole where flash attention runs, else in chunks of key_chunk keys,
    then the micro-batch's own keys under the causal mask; one log-sum-exp merge after each. Returns [T, H, Dh] in
    q's dtype."""
    T, H, Dh = q.shape
    S = k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, Dh]
    heads, step = (k.shape[1], max(S - T, 1)) if _flash_reads(qh, k) else (H, key_chunk)
    pieces = [(lo, min(lo + step, S - T), False) for lo in range(0, S - T, step)] + [(S - T, S, True)]
    out = lse = None
    for lo, hi, causal in pieces:
        o, o_lse = _piece(qh, _heads(k[lo:hi], heads), _heads(v[lo:hi], heads), causal)  # [1, H, T, Dh], [1, H, T]
        if out is None:
            out, lse = o.float(), o_lse
        else:
            merged = torch.logaddexp(lse, o_lse)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + o.float() * torch.exp(o_lse - merged).unsqueeze(-1)
            lse = merged
        del o, o_lse  # before the next chunk's: one piece alive at a time
    return out.to(q.dtype)[0].transpose(0, 1)  # [T, H, Dh]


def _flash_reads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether flash attention takes q [1, H, T, Dh] with k's Hkv heads in place (GQA in the kernel: torch's own
    check, the one its SDPA makes with enable_gqa): then nothing is repeated and its temporaries are the
    queries' size at any depth."""
    kv = k[:1].transpose(0, 1).unsqueeze(0)  # [1, Hkv, 1, Dh]: the check reads dtypes, shapes and strides
    return q.is_cuda and _flash_usable(q, kv, kv, False, k.shape[1] != q.shape[1])


def _flash_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, gqa))
    )


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """[C, Hkv, Dh] -> [1, H, C, Dh], query head h reading KV head h // (H / Hkv) (GQA): a chunk's copy only (a
    view where H is Hkv)."""
    if t.shape[1] != H:
        t = t.repeat_interleave(H // t.shape[1], dim=1)
    return t.transpose(0, 1).unsqueeze(0)


def _piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA of q [1, H, T, Dh] over one chunk k, v [1, H, C, Dh] (causal: C == T, the square mask) with the rows'
    log-sum-exp [1, H, T] (float32): the fused kernels that return it, flash where it runs, else the
    memory-efficient one on a GPU, flash's CPU form elsewhere."""
    if q.is_cuda:
        if _flash_usable(q, k, v, causal, k.shape[1] != q.shape[1]):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
            return out, lse
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
        return out, lse[..., : q.shape[2]]  # its log-sum-exp rows are padded to a multiple of 32
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse
