"""Softmax attention over the KV cache: a prompt's tokens through SDPA with a causal bias, a static (decode)
batch through the decode attention kernel on a GPU, and that batch's prologue (q/k norm, RoPE, the cache
writes) in one launch.

Two options serve gpt-oss: sinks (one learned logit per query head that joins each softmax with no value:
the weights of the real keys then sum to less than 1) and a sliding window (a query sees only the last
`window` positions, itself included). Both go through the decode kernel on a GPU, prompt or not; elsewhere
through SDPA with a float mask over one extra, all-zero key whose score is the head's sink.

A cache kept in another type (-ctk/-ctv: ops/kv_rows.QuantizedRows) is read by the decode kernel, which
dequantizes its tiles, on a GPU, and by ops/kv_rows.row_attention, a chunk of rows at a time, elsewhere.

Legend: T = tokens, S = positions in the KV cache, H / Hkv = query / key-value heads, Dh = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels import decode_attention, fused
from moestream.ops.kv_rows import QuantizedRows, row_attention, write_rows
from moestream.ops.prefix_attention import in_chunks, prefix_attention
from moestream.ops.rope import rms_norm_rope, rope_neox

MASK_ELEMENTS = 1 << 26
"""Float-mask elements (heads x queries x keys) the torch form of sinks builds at once; longer prompts go
through it in slices of queries."""


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """A static batch's attention prologue: q and k [T, H|Hkv, Dh] through rms_norm_rope by their norms and
    the rope tables (cos, sin [T, rot_dim/2]), k and v stored in caches (k, v [S, Hkv, Dh]) at the device
    positions [T]. Returns q. norms None: RoPE without norms (torch's ops: the fused launch norms)."""
    cos, sin = rope
    if norms is not None and fused.usable(q) and all(t.dtype == q.dtype for t in (k, v, *norms, cos, *_floats(caches))):
        return _fused_store(caches, positions, q.dtype, lambda c, at: fused.qkv_store(q, k, v, norms, eps, rope, c, at))
    q_norm, k_norm = norms or (None, None)
    q = rms_norm_rope(q, q_norm, eps, cos, sin)
    write_rows(caches[0], positions, rms_norm_rope(k, k_norm, eps, cos, sin))
    write_rows(caches[1], positions, v)
    return q


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """norm_rope_store for heads without q/k norms but with biases (gpt-oss): q and k [T, H|Hkv, Dh] plus their
    biases ([H*Dh], [Hkv*Dh]) rotated, k and v (plus its bias) stored in caches at the device positions [T].
    Returns q."""
    cos, sin = rope
    if fused.usable(q) and all(t.dtype == q.dtype for t in (k, v, *biases, cos, *_floats(caches))):  # one launch
        return _fused_store(
            caches, positions, q.dtype, lambda c, at: fused.qkv_store(q, k, v, None, 0.0, rope, c, at, biases)
        )
    q, k, v = (t + b.view(t.shape[1:]) for t, b in zip((q, k, v), biases, strict=True))
    write_rows(caches[0], positions, rope_neox(k, cos, sin))
    write_rows(caches[1], positions, v)
    return rope_neox(q, cos, sin)


def bias_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's q, k, v [T, H|Hkv, Dh] plus their biases, q and k rotated: rope_store's work and bits, since a
    prompt's last token may run alone as a decode step and both must give the same tokens."""
    T, device = k.shape[0], k.device
    rows = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in (k, v))
    return rope_store(q, k, v, biases, rope, rows, torch.arange(T, device=device)), *rows


def _floats(caches: tuple) -> tuple[torch.Tensor, ...]:
    """The caches kept in a torch dtype as such (stored rows are encoded after the fused launch)."""
    return tuple(c for c in caches if not isinstance(c, QuantizedRows))


def _fused_store(caches: tuple, positions: torch.Tensor, dtype: torch.dtype, launch) -> torch.Tensor:
    """launch(caches, positions) -> q, the fused prologue; with stored rows it writes T scratch rows of dtype
    instead (it writes one torch dtype), then those are encoded into the caches at positions."""
    if not any(isinstance(c, QuantizedRows) for c in caches):
        return launch(caches, positions)
    T, (Hkv, Dh) = positions.shape[0], caches[0].shape[1:]
    scratch = tuple(torch.empty((T, Hkv, Dh), dtype=dtype, device=positions.device) for _ in caches)
    q = launch(scratch, torch.arange(T, device=positions.device))
    for cache, rows in zip(caches, scratch, strict=True):
        write_rows(cache, positions, rows)
    return q


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None, window: int = 0
) -> torch.Tensor:
    """Softmax attention of q [T, H, Dh] (the last T positions) over k, v [S, Hkv, Dh] (positions 0..S-1),
    with the heads' sinks [H] in each softmax if given and only the last `window` positions seen if nonzero.

    The causal mask is aligned to the bottom right (query i sees keys up to S - T + i): SDPA's own causal flag
    when T == S, flash attention's (which aligns so) on a GPU, else a dense mask. Not torch's causal_lower_right:
    its module imports torch._dynamo, seconds of start-up for every command. Deep in a context the prefix goes
    in chunks (ops/prefix_attention.py), so the temporaries do not grow with the depth.
    """
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    if sinks is not None or window or _stored(k, v):
        positions = torch.arange(S - T, S, device=q.device)
        if decode_attention.usable(q) or _stored(k, v):
            return masked_attention(q, k, v, positions, sinks, window)
        if window and (lo := S - T - window + 1) > 0:  # keys no query of this batch sees: not read at all
            k, v, positions = k[lo:], v[lo:], positions - lo
            S = k.shape[0]
        rows = max(1, MASK_ELEMENTS // (H * S))  # queries per slice of the float mask
        return torch.cat(
            [_masked_sdpa(q[i : i + rows], k, v, positions[i : i + rows], sinks, window) for i in range(0, T, rows)]
        )
    if in_chunks(T, S):
        return prefix_attention(q, k, v)
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


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Softmax attention of q [T, H, Dh] over k, v [S, Hkv, Dh], query t seeing keys 0..positions[t] (the last
    `window` of them if nonzero), with the heads' sinks [H] in each softmax if given.

    For static batches (decode steps replayed from a graph): S is fixed and the mask comes from device
    positions. On a GPU kernels/decode_attention.py does it in one or two launches; elsewhere SDPA with a boolean
    mask, the query heads sharing a KV head going in as rows of one group, so K and V are read once.
    """
    if decode_attention.usable(q):  # one or two launches, masking from the positions itself
        (k, type_k), (v, type_v) = _kernel_rows(k), _kernel_rows(v)
        return decode_attention.attention(q, k, v, positions, sinks, window, (type_k, type_v))
    if _stored(k, v):
        return row_attention(q, k, v, positions, sinks, window)
    return _masked_sdpa(q, k, v, positions, sinks, window)


def _stored(*caches) -> bool:
    return any(isinstance(c, QuantizedRows) for c in caches)


def _kernel_rows(cache: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, str | None]:
    """A cache as the decode kernel reads it: a float tensor (any dtype), or blocks and their type."""
    if not isinstance(cache, QuantizedRows):
        return cache, None
    return cache.data, cache.name if cache.quantized else None


def _masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sinks: torch.Tensor | None,
    window: int,
) -> torch.Tensor:
    """masked_attention through SDPA. Sinks: one more key, all zeros (its score is exactly 0, its value adds
    nothing), with the head's sink as its mask value, so the float mask carries them."""
    T, H, Dh = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    rows = q.view(T, Hkv, G, Dh).transpose(0, 1).reshape(1, Hkv, T * G, Dh)  # row t*G+g: token t, head h*G+g
    key = torch.arange(S, device=q.device)[None, :]
    visible = key <= positions[:, None]  # [T, S]
    if window:
        visible &= key > positions[:, None] - window
    mask = visible.repeat_interleave(G, dim=0)[None, None]  # [1, 1, T*G, S]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, S, Dh]
    if sinks is not None:
        k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        sink = sinks.to(q.dtype).view(Hkv, 1, G).expand(Hkv, T, G).reshape(1, Hkv, T * G, 1)
        mask = torch.cat([bias.expand(1, Hkv, T * G, S), sink], dim=-1)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out[0].view(Hkv, T, G, Dh).transpose(0, 1).reshape(T, H, Dh)
