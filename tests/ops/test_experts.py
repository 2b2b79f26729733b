"""Routed experts from their stored bytes, on the CPU: each path routed_swiglu picks (a few pairs dequantized,
whole stacks, on the host, split into id ranges) against a float64 loop over tokens and experts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.ops.experts import StoredExperts, routed_swiglu
from moestream.ops.moe_swiglu import ClampedGlu

E, F_, D, K = 6, 256, 256, 2
TYPES = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
SHAPES = ((E, F_, D), (E, F_, D), (E, D, F_))


def stored_experts(ids: torch.Tensor, lo: int = 0, hi: int = E) -> StoredExperts:
    """Experts lo..hi-1 of one random layer, quantized as a Q4_K_M file stores them."""
    rng = np.random.default_rng(0)
    raws = tuple(
        torch.from_numpy(quantize((rng.standard_normal(s) * 0.05).astype(np.float32), t))[lo:hi]
        for s, t in zip(SHAPES, TYPES, strict=True)
    )
    shapes = tuple((hi - lo, *s[1:]) for s in SHAPES)

    def dequantize(s: int, rows: torch.Tensor | None) -> torch.Tensor:
        raw = raws[s] if rows is None else raws[s][rows]
        return quants.dequantize(raw, TYPES[s], (raw.shape[0], *shapes[s][1:]), torch.float32)

    return StoredExperts(raws, TYPES, shapes, ids, dequantize)


def reference(x: torch.Tensor, weights: torch.Tensor, w: StoredExperts) -> torch.Tensor:
    gate, up, down = (w.dequantize(s, None).double() for s in range(3))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, (row, picks) in enumerate(zip(x.double(), w.ids, strict=True)):
        for k, e in enumerate(picks.tolist()):
            out[t] += weights[t, k].double() * (down[e] @ (F.silu(gate[e] @ row) * (up[e] @ row)))
    return out


def inputs(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, torch.softmax(torch.randn(T, K, generator=g), -1), ids


@pytest.mark.parametrize("T", [1, 5])  # the CPU matvec from the blocks | whole stacks dequantized
@pytest.mark.parametrize("on_host", [False, True])
def test_each_path_matches_the_float64_sum(T, on_host):
    x, weights, ids = inputs(T)
    w = replace(stored_experts(ids), on_host=on_host)
    ref = reference(x, weights, w)
    if T == 1:  # a decode step on the CPU device (or the host) dequantizes nothing
        w = replace(w, dequantize=lambda *a: pytest.fail("an expert was dequantized"))
    got = routed_swiglu(x, weights, w)
    assert got.dtype == x.dtype and float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_split_into_id_ranges_gives_the_bits_of_one_device():
    x, weights, ids = inputs(5)
    whole = stored_experts(ids)
    parts = ((0, 3, stored_experts(ids, 0, 3)), (3, E, stored_experts(ids, 3, E)))
    assert torch.equal(routed_swiglu(x, weights, replace(whole, parts=parts)), routed_swiglu(x, weights, whole))


def test_the_shared_expert_and_the_residual_are_added_as_torch_adds_them():
    x, weights, ids = inputs(3)
    g = torch.Generator().manual_seed(9)
    residual, shared, logit = torch.randn(3, D, generator=g), torch.randn(3, D, generator=g), torch.randn(3, 1)
    w = stored_experts(ids)
    out = routed_swiglu(x, weights, w)
    got = routed_swiglu(x, weights, w, residual, (shared, logit))
    assert torch.equal(got, residual + (out + torch.sigmoid(logit) * shared))


def clamped_reference(x, weights, w, biases, alpha, limit):
    """gpt-oss's experts written out per token and expert in float64 (biases indexed by expert id)."""
    gate, up, down = (w.dequantize(s, None).double() for s in range(3))
    gb, ub, db = (b.double() for b in biases)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, (row, picks) in enumerate(zip(x.double(), w.ids, strict=True)):
        for k, e in enumerate(picks.tolist()):
            g = (gate[e] @ row + gb[e]).clamp(max=limit)
            u = (up[e] @ row + ub[e]).clamp(-limit, limit)
            out[t] += weights[t, k].double() * (down[e] @ (g * torch.sigmoid(alpha * g) * (u + 1)) + db[e])
    return out


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("where", ["device", "host", "parts"])
def test_clamped_experts_match_the_float64_sum_on_each_path(T, where):
    """Biases large enough that gate and up cross the limit both ways, so the clamps matter."""
    x, weights, ids = inputs(T)
    g = torch.Generator().manual_seed(11)
    biases = (torch.randn(E, F_, generator=g) * 8, torch.randn(E, F_, generator=g) * 8, torch.randn(E, D, generator=g))
    alpha, limit = 1.702, 7.0
    w = stored_experts(ids)
    if where == "host":
        w = replace(w, on_host=True)
    elif where == "parts":
        w = replace(w, parts=((0, 3, stored_experts(ids, 0, 3)), (3, E, stored_experts(ids, 3, E))))
    pairs = ids.reshape(-1)
    clamped = ClampedGlu(*(b[pairs] for b in biases), alpha, limit)
    ref = clamped_reference(x, weights, w, biases, alpha, limit)
    got = routed_swiglu(x, weights, w, clamped=clamped)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5
