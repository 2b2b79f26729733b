"""The fused decode kernels against the torch ops they replace: RMSNorm (+ RoPE) and the router's softmax
top-k."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import fused
from moestream.ops.norm import rms_norm
from moestream.ops.rope import rms_norm_rope, rope_cos_sin, rope_neox

pytestmark = pytest.mark.gpu


def reference_rms_norm(x, w, eps):  # the torch path, which ops' rms_norm does not take on CUDA
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rot", [None, 128, 64])
def test_rms_norm_and_rope(dtype, tol, rot):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 8, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(128, device="cuda", generator=g).to(dtype)
    ref = reference_rms_norm(x, w, 1e-6)
    if rot is None:
        got = rms_norm(x, w, 1e-6)
    else:
        cos, sin = rope_cos_sin(torch.tensor([0, 7, 300], device="cuda"), rot, 1e6, dtype)
        ref = rope_neox(ref, cos, sin)
        got = rms_norm_rope(x, w, 1e-6, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [2048, 96])
def test_the_residual_add_and_the_norm_after_it_in_one_launch_give_the_bits_of_both(dtype, D):
    g = torch.Generator(device="cuda").manual_seed(5)
    x, r = (torch.randn(3, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    w = torch.randn(D, device="cuda", generator=g).to(dtype)
    h, normed = fused.add_rms_norm(x, r, w, 1e-6)  # the kernel itself: ops' fallback is the reference
    assert torch.equal(h, x + r) and torch.equal(normed, fused.rms_norm(x + r, w, 1e-6))
    b = torch.randn(D, device="cuda", generator=g).to(dtype)  # gpt-oss's output projection's bias
    h, normed = fused.add_rms_norm(x, r, w, 1e-6, b)
    assert torch.equal(h, x + (r + b)) and torch.equal(normed, fused.rms_norm(x + (r + b), w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "Hkv", "Dh", "rot"), [(1, 32, 4, 128, 128), (3, 16, 2, 256, 64)])
def test_the_attention_prologue_in_one_launch_gives_the_bits_of_its_four_ops(dtype, T, H, Hkv, Dh, rot):
    """q and k norms with RoPE and the two KV-row writes of a decode step, in one launch: the same bits as the
    fused norm kernel and index_copy_, and no cache row but the positions' written."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(T, h, Dh, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    norms = tuple(torch.randn(Dh, device="cuda", generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([7, 0, 30][:T], device="cuda")
    cos, sin = rope_cos_sin(positions, rot, 1e6, dtype)
    caches = tuple(torch.randn(32, Hkv, Dh, device="cuda", generator=g).to(dtype) for _ in range(2))
    want_k, want_v = (c.clone() for c in caches)
    want_k.index_copy_(0, positions, fused.rms_norm(k, norms[1], 1e-6, cos, sin))
    want_v.index_copy_(0, positions, v)
    got = fused.qkv_store(q, k, v, norms, 1e-6, (cos, sin), caches, positions)
    assert torch.equal(got, fused.rms_norm(q, norms[0], 1e-6, cos, sin))
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("E,k", [(128, 8), (256, 8), (8, 2)])
def test_softmax_topk_matches_torch(renorm, E, k):
    """Float32 logits (bf16 ones tie often, and equal values may come in either order): same ids, same order."""
    logits = torch.randn(5, E, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    w, ids = fused.softmax_topk(logits, k, renorm, torch.float32)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    if renorm:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_adds_the_routers_bias_as_torch_would(dtype):
    """gpt-oss's router bias, added in the kernel (one launch less a layer): the weights and ids of the torch add
    (rounded to the logits' dtype) and the kernel without a bias."""
    g = torch.Generator(device="cuda").manual_seed(2)
    logits, bias = torch.randn(4, 32, device="cuda", generator=g).to(dtype), torch.randn(32, device="cuda").to(dtype)
    w, ids = fused.softmax_topk(logits, 4, True, torch.float32, bias)
    ref_w, ref_ids = fused.softmax_topk(logits + bias, 4, True, torch.float32)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


def test_softmax_topk_takes_the_lowest_id_among_equals():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], device="cuda").bfloat16()
    w, ids = fused.softmax_topk(logits, 4, True, torch.float32)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert torch.allclose(w[0, :3], w[0, :1].expand(3)) and float(w[0, 3]) < float(w[0, 0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_softmax_topk_names_real_experts_whatever_the_logits(bad):
    """An overflowed logit or a broken router weight must not make an id past the experts (ids index weights)."""
    logits = torch.zeros(3, 60, device="cuda")
    logits[0, 5] = bad
    logits[1] = bad
    logits[2, ::2] = bad
    _, ids = fused.softmax_topk(logits, 8, True, torch.float32)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60
    assert all(len(set(row)) == 8 for row in ids.tolist())  # each expert once


@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_prologue_without_norms_turns_and_stores_as_torch(dtype, tol, rot):
    """gpt-oss's heads (and GLM-4.5-Air's, half of each turned) have no q/k norms but biases: the biases' adds,
    RoPE (in float32, rounded once) and the two KV-row writes."""
    g = torch.Generator(device="cuda").manual_seed(4)
    T, H, Hkv, Dh = 2, 8, 2, 64
    q, k, v = (torch.randn(T, h, Dh, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    positions = torch.tensor([5, 17], device="cuda")
    cos, sin = rope_cos_sin(positions, rot, 150000.0, dtype)
    caches = tuple(torch.zeros(32, Hkv, Dh, device="cuda", dtype=dtype) for _ in range(2))
    biases = tuple(torch.randn(h * Dh, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    got = fused.qkv_store(q, k, v, None, 0.0, (cos, sin), caches, positions, biases)
    q, k, v = (t + b.view(-1, Dh) for t, b in zip((q, k, v), biases, strict=True))  # rounded as the kernel does
    f = [t.float() for t in (q, k, cos, sin)]
    assert float((got.float() - rope_neox(f[0], f[2], f[3])).abs().max()) < tol * 4
    assert float((caches[0][positions].float() - rope_neox(f[1], f[2], f[3])).abs().max()) < tol * 4
    assert torch.equal(caches[1][positions], v)
    others = [p for p in range(32) if p not in (5, 17)]
    assert not caches[0][others].any() and not caches[1][others].any()
