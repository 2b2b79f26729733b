"""A layer's picked experts in three launches (gate+up, down, weighted sum) against the dequantized experts,
from device memory and from page-locked host memory; each token's bits as alone; the residual and shared
expert added in the sum's launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from kernel_devices import DEVICE, INTERPRETED, gpu, gpu_or_interpreter

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.kernels import moe_matvec, tuning
from moestream.kernels.matvec import matvec
from moestream.offload.host import PinnedRanges
from moestream.ops.moe_swiglu import ClampedGlu, moe_swiglu_picked


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("down_type", [Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("where", ["device", "host"])
def test_swiglu_picked_matches_dequantized_experts(down_type, where, own_pages):
    E, F_, D, T, K = 6, 512, 768, 3, 4
    rng = np.random.default_rng(0)
    shapes = ((E, F_, D), (E, F_, D), (E, D, F_))
    types = (Q.Q4_K, Q.Q4_K, down_type)
    stored = [
        own_pages(quantize((rng.standard_normal(s) * 0.05).astype(np.float32), t))
        for s, t in zip(shapes, types, strict=True)
    ]
    pinned = PinnedRanges()
    try:
        if where == "host":
            assert pinned.register(stored)
            raws = [torch.from_numpy(s) for s in stored]
        else:
            raws = [torch.from_numpy(s).cuda() for s in stored]
        W = [
            quants.dequantize(torch.from_numpy(s), t, sh, torch.float32).cuda()
            for s, t, sh in zip(stored, types, shapes, strict=True)
        ]
        x = torch.randn(T, D, device="cuda")
        ids = torch.tensor([[5, 0, 2, 3], [1, 5, 3, 4], [0, 1, 2, 5]], device="cuda")
        weights = torch.rand(T, K, device="cuda")
        mv = [lambda picks, rows, w=w: torch.einsum("pod,pd->po", w[picks], rows) for w in W]
        ref = moe_swiglu_picked(x, weights, ids, *mv)
        assert moe_matvec.fuses(types)
        got = moe_matvec.swiglu_picked(x, weights, ids, raws, types, F_)
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
        got16 = moe_matvec.swiglu_picked(x.bfloat16(), weights.bfloat16(), ids, raws, types, F_)
        assert got16.dtype == torch.bfloat16
        assert float((got16.float() - ref).abs().max() / ref.abs().max()) < 3e-2
    finally:
        pinned.unregister()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K", [2, 8])
def test_each_token_of_a_launch_gets_the_bits_it_gets_alone(K):
    """bf16, as served: the matvec's tile and the experts' weighted sum are chosen per token (a batched decode
    step must give each sequence the logits of its step alone)."""
    E, D, F = 16, 512, 256
    rng = np.random.default_rng(2)
    stacks = [(rng.standard_normal((E, *shape)) * 0.05).astype(np.float32) for shape in ((F, D), (F, D), (D, F))]
    raws = [torch.from_numpy(quantize(s, q)).cuda() for s, q in zip(stacks, (Q.Q4_K, Q.Q4_K, Q.Q6_K), strict=True)]
    T = tuning.current().max_tokens
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    weights = torch.softmax(torch.randn(T, K, device="cuda"), -1).bfloat16()
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    together = moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    dense = matvec(raws[0][0], Q.Q4_K, F, x)
    for t in range(T):
        alone = moe_matvec.swiglu_picked(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], raws, qtypes, F)
        assert torch.equal(together[t : t + 1], alone)
        assert torch.equal(dense[t : t + 1], matvec(raws[0][0], Q.Q4_K, F, x[t : t + 1]))


@pytest.mark.gpu
@gpu_or_interpreter
def test_grid_type_experts_match_dequantized_experts():
    """Gate and up IQ2_XXS, down IQ3_S: the gate-and-up launch and the down matvec each read their type's grid
    table."""
    E, F_, D, T, K = 4, 256, 256, 2, 2
    rng = np.random.default_rng(5)
    types, shapes = (Q.IQ2_XXS, Q.IQ2_XXS, Q.IQ3_S), ((E, F_, D), (E, F_, D), (E, D, F_))
    stored = [quantize(rng.standard_normal(s).astype(np.float32), t) for s, t in zip(shapes, types, strict=True)]
    W = [quants.dequantize(torch.from_numpy(r), t, s) for r, t, s in zip(stored, types, shapes, strict=True)]
    x = torch.randn(T, D)
    ids, weights = torch.tensor([[3, 0], [1, 3]]), torch.rand(T, K)
    mv = [lambda picks, rows, w=w: torch.einsum("pod,pd->po", w[picks], rows) for w in W]
    ref = moe_swiglu_picked(x, weights, ids, *mv)
    assert moe_matvec.fuses(types)
    raws = [torch.from_numpy(r).to(DEVICE) for r in stored]
    got = moe_matvec.swiglu_picked(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), raws, types, F_).cpu()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0]
)
def test_swiglu_picked_takes_each_types_experts(qtype):
    """gate, up and down of every type with a dot through the three launches, against the dequantized experts."""
    E, F_, D, T, K = 3, 256, 256, 2, 2
    rng = np.random.default_rng(5)
    shapes = ((E, F_, D), (E, F_, D), (E, D, F_))
    stored = [quantize((rng.standard_normal(s) * 0.05).astype(np.float32), qtype) for s in shapes]
    W = [quants.dequantize(torch.from_numpy(s), qtype, sh, torch.float32) for s, sh in zip(stored, shapes, strict=True)]
    x = torch.randn(T, D)
    ids = torch.tensor([[2, 0], [1, 2]])
    weights = torch.rand(T, K)
    mv = [lambda picks, rows, w=w: torch.einsum("pod,pd->po", w[picks], rows) for w in W]
    ref = moe_swiglu_picked(x, weights, ids, *mv)
    assert moe_matvec.fuses((qtype,) * 3)
    raws = [torch.from_numpy(s).to(DEVICE) for s in stored]
    got = moe_matvec.swiglu_picked(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), raws, (qtype,) * 3, F_).cpu()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("one_table", [False, True], ids=["apart", "one-table"])
def test_clamped_experts_in_the_three_launches(qtype, one_table):
    """gpt-oss's experts: per-pair gate, up and down biases and the clamped GLU inside the gate-and-up and sum
    launches, against the torch form over the dequantized experts; biases large enough to cross the clamps.
    one_table: the biases are views of one [P, 2F + D] gather, as models/gpt_oss.py makes them."""
    E, F_, D, T, K = 4, 96, 160, 2, 3  # gpt-oss's tiny widths: rows of no power of two
    rng = np.random.default_rng(6)
    shapes = ((E, F_, D), (E, F_, D), (E, D, F_))
    stored = [quantize((rng.standard_normal(s) * 0.3).astype(np.float32), qtype) for s in shapes]
    W = [quants.dequantize(torch.from_numpy(s), qtype, sh, torch.float32) for s, sh in zip(stored, shapes, strict=True)]
    x = torch.randn(T, D)
    ids = torch.tensor([[2, 0, 3], [1, 2, 0]])
    weights = torch.softmax(torch.randn(T, K), -1)
    g = torch.Generator().manual_seed(7)
    biases = [torch.randn(T * K, n, generator=g) * 6 for n in (F_, F_, D)]
    clamped = ClampedGlu(*biases, 1.702, 7.0)
    mv = [lambda picks, rows, w=w: torch.einsum("pod,pd->po", w[picks], rows) for w in W]
    ref = moe_swiglu_picked(x, weights, ids, *mv, clamped)
    plain = moe_swiglu_picked(x, weights, ids, *mv)
    raws = [torch.from_numpy(s).to(DEVICE) for s in stored]
    if one_table:
        on = ClampedGlu(*torch.cat(biases, dim=1).to(DEVICE).split([F_, F_, D], dim=1), 1.702, 7.0)
        assert on.gate_bias.stride(0) == 2 * F_ + D  # read in place, not copied
    else:
        on = ClampedGlu(*(b.to(DEVICE) for b in biases), 1.702, 7.0)
    got = moe_matvec.swiglu_picked(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), raws, (qtype,) * 3, F_, clamped=on)
    assert float((got.cpu() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert float((plain - ref).abs().max() / ref.abs().max()) > 0.1  # the biases and clamps matter here


def _experts_case(dtype: torch.dtype, seed: int, F: int, T: int, E: int = 4, D: int = 256, K: int = 2) -> tuple:
    """E experts (gate, up Q4_K; down Q6_K) of width F, T tokens routed to K of them, and a residual."""
    rng = np.random.default_rng(seed)
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    stacks = [(rng.standard_normal((E, *shape)) * 0.05).astype(np.float32) for shape in ((F, D), (F, D), (D, F))]
    raws = [torch.from_numpy(quantize(s, q)).to(DEVICE) for s, q in zip(stacks, qtypes, strict=True)]
    x = torch.randn(T, D, device=DEVICE).to(dtype)
    residual = torch.randn(T, D, device=DEVICE).to(dtype) * 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(DEVICE)
    weights = torch.softmax(torch.randn(T, K, device=DEVICE), -1).to(dtype)
    return stacks, raws, qtypes, x, residual, ids, weights


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_added_in_the_sums_launch_has_the_bits_of_adding_it_after(dtype):
    """The layer's skip connection goes into the weighted sum's launch (one launch a layer fewer); the sum is
    rounded to the dtype first, so the output is what residual + swiglu_picked(...) gives in torch."""
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 rounding is not the GPU's")
    F, T = 256, 2
    stacks, raws, qtypes, x, residual, ids, weights = _experts_case(dtype, 3, F, T)
    alone = moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    fused = moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual)
    assert torch.equal(fused, residual + alone)
    assert not torch.equal(fused, alone)
    with pytest.raises(ValueError, match="not like x"):  # a broadcast residual would be read past its end
        moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual[:1])


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_added_in_the_sums_launch_as_torch_adds_it(dtype):
    """qwen35moe's shared expert: its gate and up in one launch (swiglu), sigmoid(gate) * its output and the
    residual in the routed sum's launch, each step rounded as torch rounds it (float32: within 1e-6, the
    sigmoids differ; bf16: within a rounding step, sm_90 rounding the shared product and sum once)."""
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 rounding is not the GPU's")
    F, T = 256, 2
    stacks, raws, qtypes, x, residual, ids, weights = _experts_case(dtype, 4, F, T)
    h = moe_matvec.swiglu(x, raws[:2], qtypes[:2], F)  # the shared expert: expert 0's gate and up as dense weights
    W = [quants.dequantize(r.cpu(), q, s.shape, torch.float64) for r, q, s in zip(raws, qtypes, stacks, strict=True)]
    want_h = torch.nn.functional.silu(x.cpu().double() @ W[0][0].T) * (x.cpu().double() @ W[1][0].T)
    assert float((h.cpu().double() - want_h).abs().max() / want_h.abs().max()) < (
        1e-5 if dtype == torch.float32 else 2e-2
    )
    shared, gate = torch.randn_like(residual), torch.randn(T, 1, device=DEVICE).to(dtype)
    alone = moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    fused = moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual, (shared, gate))
    want = residual + (alone + torch.sigmoid(gate) * shared)
    if dtype == torch.float32:
        assert float((fused - want).abs().max() / want.abs().max()) < 1e-6
    else:
        assert float((fused.float() - want.float()).abs().max() / want.float().abs().max()) < 1e-2
    assert not torch.allclose(fused, residual + alone)
    for one in range(T):  # each token's bits as alone
        rows = slice(one, one + 1)
        alone_t = moe_matvec.swiglu_picked(
            x[rows], weights[rows], ids[rows], raws, qtypes, F, residual[rows], (shared[rows], gate[rows])
        )
        assert torch.equal(alone_t, fused[rows])
    with pytest.raises(ValueError, match="shared gate"):  # one gate for two tokens would be read past its end
        moe_matvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual, (shared, gate[:1]))
