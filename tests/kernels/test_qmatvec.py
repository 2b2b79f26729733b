"""Quantized matvec against dequantize-then-multiply (float32), from device memory and from page-locked host
memory, for single matrices and expert stacks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.kernels import qmatvec
from moestream.kernels.qmatvec import matvec
from moestream.offload.host import PinnedRanges

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Triton's interpreter (TRITON_INTERPRET=1, triton importable) runs the kernels on CPU tensors: the tests that
# take DEVICE run there too (float32 only checked tightly), e.g. before device time is spent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and bool(qmatvec.DOTS)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_or_interpreter = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED), reason="needs CUDA or Triton's interpreter"
)


def test_tiles_shrink_until_the_grid_spreads():
    H200 = 264  # two programs for each of its 132 multiprocessors
    assert qmatvec._tile(8, 4, 4096, 1, H200) == (8, 4)  # a q projection: 512 programs as it is
    assert qmatvec._tile(8, 4, 512, 1, H200) == (1, 1)  # a k projection: 64 programs at 8 rows, 512 at 1
    assert qmatvec._tile(8, 4, 768, 8, H200) == (8, 4)  # eight experts' gate/up rows: 768 programs
    assert qmatvec._tile(8, 4, 2048, 1, H200) == (4, 2)  # the o projection of one token: 512 programs
    assert qmatvec._tile(8, 4, 512, 1, 0) == (8, 4)  # no minimum (the CPU): as given
    n_out, n_vec = 100, 2
    rows, _ = qmatvec._tile(8, 4, n_out, n_vec, H200)
    assert rows == 1 or -(-n_out // rows) * n_vec >= H200


def test_blocks_loaded_together_divide_the_row():
    assert [qmatvec._at_once(n, 4) for n in (3, 4, 8, 16)] == [1, 4, 4, 4]  # rows of 768 ... 4096 (K-quants)
    assert qmatvec._at_once(6, 4) == 2 and qmatvec._at_once(8, 1) == 1 and qmatvec._at_once(24, 8) == 8


def test_blocks_off_word_alignment_are_refused():
    """The Q4_K dot loads 32-bit words, Q6_K's 16-bit words: a view starting off their boundary would read
    wrong values."""
    buf = torch.zeros(4 + 210 * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        qmatvec._layout(Q.Q4_K, 256, buf[2 : 2 + 288].view(2, 144), 1)
    with pytest.raises(ValueError, match="2-byte aligned"):
        qmatvec._layout(Q.Q6_K, 256, buf[1 : 1 + 420].view(2, 210), 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0])
@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("n_in", [768, 2048])  # K-quants: 3 blocks a row, one at a time; 8, loaded together
def test_matvec_matches_dequantized_product(qtype, where, n_in, own_pages):
    w = (np.random.default_rng(0).standard_normal((6, 72, n_in)) * 0.05).astype(np.float32)  # 72: a partial tile
    stored = own_pages(quantize(w, qtype))
    pinned = PinnedRanges()
    if where == "host":
        assert pinned.register([stored])
        raw = torch.from_numpy(stored)
    else:
        raw = torch.from_numpy(stored).cuda()
    try:
        W = quants.dequantize(torch.from_numpy(stored), qtype, w.shape, torch.float32).cuda()
        x = torch.randn(5, n_in, device="cuda")
        mats = torch.tensor([5, 0, 5, 2, 3], device="cuda")
        got = matvec(raw, qtype, 72, x, mats)
        ref = torch.einsum("pod,pd->po", W[mats], x)
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
        one = matvec(raw[4], qtype, 72, x)
        assert float((one - x @ W[4].T).abs().max() / ref.abs().max()) < 1e-5
        got16 = matvec(raw, qtype, 72, x.bfloat16(), mats)
        assert got16.dtype == torch.bfloat16
        assert float((got16.float() - ref).abs().max() / ref.abs().max()) < 2e-2
    finally:
        pinned.unregister()


def _q6_k_bit_patterns(rng: np.random.Generator, rows: tuple[int, ...], n_in: int) -> np.ndarray:
    """Q6_K rows of random bytes (every ql/qh bit pattern, scales of both signs) with finite d, and blocks at
    the extremes: every 6-bit value 63 or 0 (q = 31, -32), every scale -128, 127 or a mix of both signs."""
    b = rng.integers(0, 256, size=(*rows, n_in // 256, 210), dtype=np.uint8)
    flat = b.reshape(-1, 210)
    flat[0::5, :192], flat[1::5, :192] = 0xFF, 0x00
    flat[0::3, 192:208], flat[1::3, 192:208] = 0x80, 0x7F
    flat[2::3, 192:208] = np.tile(np.array([0x80, 0x7F, 0x81, 0x01, 0xFF, 0x00, 0x7E, 0xC0], np.uint8), 2)
    d = (rng.standard_normal(len(flat)) * rng.choice([0.01, 1.0], len(flat))).astype(np.float16)
    flat[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(*rows, -1)


def _k_bit_patterns(rng: np.random.Generator, rows: tuple[int, ...], n_in: int, size: int) -> np.ndarray:
    """Q4_K (size 144) or Q5_K (176) rows of random bytes: every nibble, fifth bit and 6-bit scale and min
    pattern, with finite d and dmin, and blocks at the extremes (all bits set, none set)."""
    b = rng.integers(0, 256, size=(*rows, n_in // 256, size), dtype=np.uint8)
    flat = b.reshape(-1, size)
    flat[0::5, 4:], flat[1::5, 4:] = 0xFF, 0x00
    d = (rng.standard_normal((len(flat), 2)) * rng.choice([0.01, 1.0], (len(flat), 1))).astype(np.float16)
    flat[:, :4] = d.view(np.uint8).reshape(-1, 4)
    return b.reshape(*rows, -1)


def _bit_patterns(rng: np.random.Generator, qtype: Q, rows: tuple[int, ...], n_in: int) -> np.ndarray:
    """Rows of qtype (a K-quant) over all its bit patterns, as the two functions above make them."""
    if qtype == Q.Q6_K:
        return _q6_k_bit_patterns(rng, rows, n_in)
    return _k_bit_patterns(rng, rows, n_in, {Q.Q4_K: 144, Q.Q5_K: 176}[qtype])


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("n_in", [256, 768, 2048])  # 1, 3 (one at a time) and 8 blocks (loaded together) a row
def test_k_quant_dots_read_every_bit_pattern(qtype, n_in, stacked):
    """The K-quant dots (word loads; Q4_K/Q5_K values as 1 + n / 16 or 32 floats; Q6_K's int8 scale pair
    sign-extended per lane half) against the dequantized product, in float32, over all bit patterns and the
    extreme scales."""
    rng = np.random.default_rng(6)
    stored = _bit_patterns(rng, qtype, (4, 19) if stacked else (19,), n_in)  # 19: a partial tile
    W = quants.dequantize(torch.from_numpy(stored), qtype, (*stored.shape[:-1], n_in), torch.float32).double()
    raw = torch.from_numpy(stored).to(DEVICE)
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(n_in))
    if stacked:
        mats = torch.tensor([3, 0, 3])
        got = matvec(raw, qtype, 19, x.to(DEVICE), mats.to(DEVICE)).cpu()
        ref = torch.einsum("pod,pd->po", W[mats], x.double())
    else:
        got = matvec(raw, qtype, 19, x.to(DEVICE)).cpu()
        ref = x.double() @ W.T
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_a_bfloat16_x_read_packed_gives_the_bits_of_reading_it_as_float32(qtype):
    """The K-quant dots read a bfloat16 x 4 (Q6_K: 2) values a load and take each apart by shifts: the float32
    sums must be those of the same values read one by one as float32, so the rounded results are equal."""
    rng = np.random.default_rng(7)
    stored = _bit_patterns(rng, qtype, (4, 19), 2048)
    raw = torch.from_numpy(stored).to(DEVICE)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    mats = torch.tensor([3, 0, 3], device=DEVICE)
    for picks in (None, mats):
        packed = matvec(raw, qtype, 19, x, picks)
        assert packed.dtype == torch.bfloat16
        assert torch.equal(packed, _as_kernel_rounds(matvec(raw, qtype, 19, x.float(), picks)))


def _as_kernel_rounds(y: torch.Tensor) -> torch.Tensor:
    """float32 y stored as bfloat16 the way the kernels' stores convert it: to nearest on the GPU, by cutting
    the low 16 bits in Triton's interpreter."""
    if INTERPRETED:
        y = (y.view(torch.int32) & -65536).view(torch.float32)
    return y.bfloat16()


def test_x_off_a_16_byte_boundary_is_copied_to_one():
    x = torch.arange(2049, dtype=torch.bfloat16)[1:]  # starts 2 bytes into an allocation
    got = qmatvec._x(x)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, x)
    aligned = torch.zeros(2, 2048, dtype=torch.bfloat16)
    assert qmatvec._x(aligned).data_ptr() == aligned.data_ptr()  # no copy


def test_a_few_rows_multiply_as_each_would_alone():
    w = torch.randn(7, 16)
    for rows in (0, 1, 3, 5):  # 5: more than MAX_TOKENS, one product
        x = torch.randn(rows, 16)
        got = qmatvec.linear_each_row(x, w)
        assert got.shape == (rows, 7) and torch.allclose(got, x @ w.T, atol=1e-5)
        if 1 < rows <= qmatvec.MAX_TOKENS:
            assert all(torch.equal(got[i : i + 1], torch.nn.functional.linear(x[i : i + 1], w)) for i in range(rows))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_float_weights_of_a_few_rows_go_through_the_matvec_row_by_row(dtype, tol):
    """The router's product (and other float weights') for a decode step: the matvec's float dots, each row
    the bits it gets alone; prefill's many rows stay on F.linear."""
    w = torch.randn(128, 2048, device="cuda").to(dtype)
    for rows in (1, 3, qmatvec.MAX_TOKENS):
        x = torch.randn(rows, 2048, device="cuda").to(dtype)
        assert qmatvec.reads_float(x, w)  # else F.linear row by row would pass this test too
        got = qmatvec.linear_each_row(x, w)
        assert torch.equal(got, matvec(w.view(torch.uint8), qmatvec.FLOAT_QTYPES[dtype], 128, x))
        ref = x.float() @ w.float().T
        assert got.dtype == dtype and float((got.float() - ref).abs().max() / ref.abs().max()) < tol
        assert all(torch.equal(got[i : i + 1], qmatvec.linear_each_row(x[i : i + 1], w)) for i in range(rows))
    x = torch.randn(qmatvec.MAX_TOKENS + 1, 2048, device="cuda").to(dtype)
    assert torch.equal(qmatvec.linear_each_row(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.BF16), (Q.Q8_0, Q.Q4_K, Q.BF16, Q.Q6_K)], ids=["qkv", "2", "4"]
)
def test_matrices_of_one_x_in_one_launch_match_each_alone(types):
    """A layer's q, k, v (qwen3.6's delta-net: four projections, two of them float) in one matvecs launch: each
    within float rounding of its own matvec, each row of x the bits it gets alone."""
    rng = np.random.default_rng(4)
    D, parts = 2048, []
    for qtype, n_out in zip(types, (4096, 500, 36, 3), strict=False):  # partial tiles at the parts' edges
        w = (rng.standard_normal((n_out, D)) * 0.05).astype(np.float32)
        if qtype == Q.BF16:
            parts.append((torch.from_numpy(w).cuda().bfloat16().view(torch.uint8), qtype, n_out))
        else:
            parts.append((torch.from_numpy(quantize(w, qtype)).cuda(), qtype, n_out))
    x = torch.randn(qmatvec.MAX_TOKENS, D, device="cuda", dtype=torch.bfloat16)
    together = qmatvec.matvecs(parts, x)
    for (raw, qtype, n_out), y in zip(parts, together, strict=True):
        alone = matvec(raw, qtype, n_out, x)
        assert y.shape == (x.shape[0], n_out)
        assert float((y.float() - alone.float()).abs().max() / alone.float().abs().max()) < 1e-2, qtype.name
    for i in range(x.shape[0]):
        row = qmatvec.matvecs(parts, x[i : i + 1])
        assert all(torch.equal(a[i : i + 1], b) for a, b in zip(together, row, strict=True)), f"row {i}"


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
    T = qmatvec.MAX_TOKENS
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    weights = torch.softmax(torch.randn(T, K, device="cuda"), -1).bfloat16()
    qtypes = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    together = qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    dense = matvec(raws[0][0], Q.Q4_K, F, x)
    for t in range(T):
        alone = qmatvec.swiglu_picked(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], raws, qtypes, F)
        assert torch.equal(together[t : t + 1], alone)
        assert torch.equal(dense[t : t + 1], matvec(raws[0][0], Q.Q4_K, F, x[t : t + 1]))


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
    alone = qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    fused = qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual)
    assert torch.equal(fused, residual + alone)
    assert not torch.equal(fused, alone)
    with pytest.raises(ValueError, match="not like x"):  # a broadcast residual would be read past its end
        qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual[:1])


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
    h = qmatvec.swiglu(x, raws[:2], qtypes[:2], F)  # the shared expert: expert 0's gate and up as dense weights
    W = [quants.dequantize(r.cpu(), q, s.shape, torch.float64) for r, q, s in zip(raws, qtypes, stacks, strict=True)]
    want_h = torch.nn.functional.silu(x.cpu().double() @ W[0][0].T) * (x.cpu().double() @ W[1][0].T)
    assert float((h.cpu().double() - want_h).abs().max() / want_h.abs().max()) < (
        1e-5 if dtype == torch.float32 else 2e-2
    )
    shared, gate = torch.randn_like(residual), torch.randn(T, 1, device=DEVICE).to(dtype)
    alone = qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F)
    fused = qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual, (shared, gate))
    want = residual + (alone + torch.sigmoid(gate) * shared)
    if dtype == torch.float32:
        assert float((fused - want).abs().max() / want.abs().max()) < 1e-6
    else:
        assert float((fused.float() - want.float()).abs().max() / want.float().abs().max()) < 1e-2
    assert not torch.allclose(fused, residual + alone)
    for one in range(T):  # each token's bits as alone
        rows = slice(one, one + 1)
        alone_t = qmatvec.swiglu_picked(
            x[rows], weights[rows], ids[rows], raws, qtypes, F, residual[rows], (shared[rows], gate[rows])
        )
        assert torch.equal(alone_t, fused[rows])
    with pytest.raises(ValueError, match="shared gate"):  # one gate for two tokens would be read past its end
        qmatvec.swiglu_picked(x, weights, ids, raws, qtypes, F, residual, (shared, gate[:1]))
