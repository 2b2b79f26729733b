"""Attention's torch forms: the static batch's masked attention equals causal attention where the masks agree,
and its prologue writes the cache rows at the batch's positions."""

from __future__ import annotations

import torch

from moestream.ops.attention import causal_attention, masked_attention, norm_rope_store
from moestream.ops.rope import rms_norm_rope, rope_cos_sin


def test_masked_attention_over_the_last_positions_is_causal_attention():
    """Queries at positions S-T..S-1 with a boolean mask see what the bottom-right causal bias lets them see
    (GQA: 8 query heads over 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    T, S, H, Hkv, Dh = 3, 11, 8, 2, 16
    q = torch.randn(T, H, Dh, generator=g)
    k, v = (torch.randn(S, Hkv, Dh, generator=g) for _ in range(2))
    got = masked_attention(q, k, v, torch.arange(S - T, S))
    torch.testing.assert_close(got, causal_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_norm_rope_store_writes_k_and_v_at_the_positions():
    g = torch.Generator().manual_seed(1)
    T, S, H, Hkv, Dh = 2, 9, 4, 2, 16
    q, k, v = (torch.randn(T, h, Dh, generator=g) for h in (H, Hkv, Hkv))
    norms = (torch.randn(Dh, generator=g), torch.randn(Dh, generator=g))
    positions = torch.tensor([6, 2])
    cos, sin = rope_cos_sin(positions, Dh, 1e4, torch.float32)
    caches = (torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh))
    got = norm_rope_store(q, k, v, norms, 1e-6, (cos, sin), caches, positions)
    assert torch.equal(got, rms_norm_rope(q, norms[0], 1e-6, cos, sin))
    assert torch.equal(caches[0][positions], rms_norm_rope(k, norms[1], 1e-6, cos, sin))
    assert torch.equal(caches[1][positions], v)
    others = [p for p in range(S) if p not in positions.tolist()]
    assert not caches[0][others].any() and not caches[1][others].any()
