"""Attention's torch forms: the static batch's masked attention equals causal attention where the masks agree,
its prologue writes the cache rows at the batch's positions, and sinks and a sliding window give what a
softmax over [scores, sink] written out computes."""

from __future__ import annotations

import pytest
import torch

from moestream.ops import attention
from moestream.ops.attention import causal_attention, masked_attention, norm_rope_store, rope_store
from moestream.ops.rope import rms_norm_rope, rope_cos_sin, rope_neox


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


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64, query t (of the last T positions) seeing keys 0..S-T+t, GQA by repeat."""
    T, H, Dh = q.shape
    S, Hkv, _ = k.shape
    k, v = (x.double().repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), k) / Dh**0.5
    visible = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def test_causal_attention_aligns_the_mask_bottom_right():
    """A whole prompt (T == S) and a chunk after cached positions (T < S), against float64 math."""
    g = torch.Generator().manual_seed(2)
    for T, S in ((7, 7), (3, 11), (1, 5)):
        q = torch.randn(T, 8, 16, generator=g)
        k, v = (torch.randn(S, 2, 16, generator=g) for _ in range(2))
        torch.testing.assert_close(causal_attention(q, k, v).double(), _reference(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_causal_attention_on_a_gpu_chunk_takes_flash_with_the_same_mask():
    g = torch.Generator().manual_seed(3)
    T, S = 64, 192
    q = torch.randn(T, 8, 128, generator=g)
    k, v = (torch.randn(S, 2, 128, generator=g) for _ in range(2))
    got = causal_attention(*(x.cuda().bfloat16() for x in (q, k, v)))
    torch.testing.assert_close(got.double().cpu(), _reference(q, k, v), rtol=2e-2, atol=2e-2)


def written_out(q, k, v, positions, sinks, window):
    """Each query head's softmax over its visible keys' scores and its sink, in float64, head by head."""
    T, H, Dh = q.shape
    G = H // k.shape[1]
    out = torch.zeros(T, H, Dh, dtype=torch.float64)
    for t, p in enumerate(positions.tolist()):
        keys = [j for j in range(p + 1) if not window or p - j < window]
        for h in range(H):
            scores = k[keys, h // G].double() @ q[t, h].double() / Dh**0.5
            probs = torch.softmax(torch.cat([scores, sinks[h : h + 1].double()]), 0)[:-1]
            out[t, h] = probs @ v[keys, h // G].double()
    return out


@pytest.mark.parametrize("window", [0, 4])
def test_sinks_and_window_are_a_softmax_over_scores_and_sink(window, monkeypatch):
    g = torch.Generator().manual_seed(2)
    T, S, H, Hkv, Dh = 6, 13, 6, 2, 8
    q = torch.randn(T, H, Dh, generator=g)
    k, v = (torch.randn(S, Hkv, Dh, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g) * 3
    want = written_out(q, k, v, torch.arange(S - T, S), sinks, window)
    torch.testing.assert_close(causal_attention(q, k, v, sinks, window).double(), want, rtol=1e-5, atol=1e-6)
    positions = torch.tensor([0, 3, 12])
    got = masked_attention(q[:3], k, v, positions, sinks, window)
    torch.testing.assert_close(got.double(), written_out(q[:3], k, v, positions, sinks, window), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", H * S * 2)  # a prompt in slices of two queries
    torch.testing.assert_close(causal_attention(q, k, v, sinks, window).double(), want, rtol=1e-5, atol=1e-6)


def test_rope_store_rotates_q_and_k_and_writes_the_cache():
    g = torch.Generator().manual_seed(3)
    T, S, H, Hkv, Dh = 2, 9, 4, 2, 16
    q, k, v = (torch.randn(T, h, Dh, generator=g) for h in (H, Hkv, Hkv))
    positions = torch.tensor([6, 2])
    cos, sin = rope_cos_sin(positions, Dh, 1e4, torch.float32)
    caches = (torch.zeros(S, Hkv, Dh), torch.zeros(S, Hkv, Dh))
    biases = tuple(torch.randn(h * Dh, generator=g) for h in (H, Hkv, Hkv))
    got = rope_store(q, k, v, biases, (cos, sin), caches, positions)
    q, k, v = (t + b.view(-1, Dh) for t, b in zip((q, k, v), biases, strict=True))
    assert torch.equal(got, rope_neox(q, cos, sin))
    assert torch.equal(caches[0][positions], rope_neox(k, cos, sin)) and torch.equal(caches[1][positions], v)
