"""Quantized matvec against dequantize-then-multiply (float32), from device memory and from page-locked host
memory, for single matrices and expert stacks; the tiles it picks; float weights of a few rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from kernel_devices import DEVICE, gpu, gpu_or_interpreter

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.kernels import matvec as mv
from moestream.kernels import moe_matvec, tuning
from moestream.kernels.dots import DOTS, FLOAT_QTYPES
from moestream.kernels.matvec import matvec
from moestream.offload.host import PinnedRanges

MAX_TOKENS = tuning.current().max_tokens


def test_tiles_shrink_until_the_grid_spreads():
    H200 = 264  # two programs for each of its 132 multiprocessors
    assert mv.tile(8, 4, 4096, 1, H200) == (8, 4)  # a q projection: 512 programs as it is
    assert mv.tile(8, 4, 512, 1, H200) == (1, 1)  # a k projection: 64 programs at 8 rows, 512 at 1
    assert mv.tile(8, 4, 768, 8, H200) == (8, 4)  # eight experts' gate/up rows: 768 programs
    assert mv.tile(8, 4, 2048, 1, H200) == (4, 2)  # the o projection of one token: 512 programs
    assert mv.tile(8, 4, 512, 1, 0) == (8, 4)  # no minimum (the CPU): as given
    n_out, n_vec = 100, 2
    rows, _ = mv.tile(8, 4, n_out, n_vec, H200)
    assert rows == 1 or -(-n_out // rows) * n_vec >= H200


def test_blocks_loaded_together_are_a_power_of_two_within_the_row():
    assert [mv.blocks_at_once(n, 4) for n in (1, 3, 4, 8, 16)] == [1, 2, 4, 4, 4]  # rows of 256 ... 4096 (K-quants)
    assert mv.blocks_at_once(6, 4) == 4 and mv.blocks_at_once(8, 1) == 1 and mv.blocks_at_once(24, 8) == 8
    # gpt-oss's rows of 2880 values: 90 blocks of 32, read 8 at a time and the last 2 masked, not 2 at a time
    assert mv.blocks_at_once(90, 8) == 8


def test_blocks_off_word_alignment_are_refused():
    """The Q4_K dot loads 32-bit words, Q6_K's 16-bit words: a view starting off their boundary would read
    wrong values."""
    buf = torch.zeros(4 + 210 * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        mv.layout(Q.Q4_K, 256, buf[2 : 2 + 288].view(2, 144), 1, 1)
    with pytest.raises(ValueError, match="2-byte aligned"):
        mv.check_aligned(Q.Q6_K, buf[1 : 1 + 420].view(2, 210))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", sorted(DOTS), ids=lambda t: t.name)
@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("n_in", [768, 2048, 2880])  # K-quants: 3 blocks a row, one at a time; 8, loaded together
def test_matvec_matches_dequantized_product(qtype, where, n_in, own_pages):
    if n_in % GGML_QUANT_SIZES[qtype][0]:
        pytest.skip(f"{qtype.name} rows are whole blocks of {GGML_QUANT_SIZES[qtype][0]}")  # 2880: 90 blocks of 32
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


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize(
    "qtype",
    [
        Q.Q4_K,
        pytest.param(
            Q.Q6_K,
            marks=pytest.mark.xfail(
                torch.cuda.is_available(),
                strict=True,
                reason="the gate-and-up launch missed 1e-5 on an H100 (session 28; the matvec passed, as did the "
                "interpreter): not isolated yet. Defaults read K-quants one block a turn, where no turn is partial",
            ),
        ),
        Q.IQ4_XS,
        Q.IQ1_M,
    ],
    ids=lambda t: t.name,
)
def test_a_rows_last_turn_past_its_end_reads_only_its_blocks(qtype):
    """5 blocks of 256 read 4 at a time: the second turn's last 3 are masked (and the pair's, for gate and up)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 2, 40, 1280)).astype(np.float32)
    stored = [torch.from_numpy(quantize(m, qtype)).to(DEVICE) for m in w]
    W = [quants.dequantize(s.cpu(), qtype, (2, 40, 1280)) for s in stored]
    x, ids = torch.randn(1, 1280), torch.tensor([[1, 0]])
    with tuning.use(blocks_at_once=4, gate_up_blocks_at_once=4):
        assert mv.layout(qtype, 1280, stored[0], 4, 16)[1]["B"] == 4
        y = matvec(stored[0], qtype, 40, x.repeat(2, 1).to(DEVICE), ids[0].to(DEVICE))  # a row of x a pair
        h = moe_matvec._gate_up(x.to(DEVICE), stored, (qtype, qtype), 40, ids.reshape(-1).to(DEVICE), 2)
    ref = torch.stack([W[0][e] @ x[0] for e in (1, 0)])
    assert float((y.cpu() - ref).abs().max() / ref.abs().max()) < 1e-5
    g, u = (torch.stack([W[i][e] @ x[0] for e in (1, 0)]) for i in (0, 1))
    ref_h = g * torch.sigmoid(g) * u
    assert float((h.cpu() - ref_h).abs().max() / ref_h.abs().max()) < 1e-5


def test_x_off_a_16_byte_boundary_is_copied_to_one():
    x = torch.arange(2049, dtype=torch.bfloat16)[1:]  # starts 2 bytes into an allocation
    got = mv.aligned_x(x)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, x)
    aligned = torch.zeros(2, 2048, dtype=torch.bfloat16)
    assert mv.aligned_x(aligned).data_ptr() == aligned.data_ptr()  # no copy


def test_a_few_rows_multiply_as_each_would_alone():
    w = torch.randn(7, 16)
    for rows in (0, 1, 3, 5):  # 5: more than MAX_TOKENS, one product
        x = torch.randn(rows, 16)
        got = mv.linear_each_row(x, w)
        assert got.shape == (rows, 7) and torch.allclose(got, x @ w.T, atol=1e-5)
        if 1 < rows <= MAX_TOKENS:
            assert all(torch.equal(got[i : i + 1], torch.nn.functional.linear(x[i : i + 1], w)) for i in range(rows))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_float_weights_of_a_few_rows_go_through_the_matvec_row_by_row(dtype, tol):
    """The router's product (and other float weights') for a decode step: the matvec's float dots, each row
    the bits it gets alone; prefill's many rows stay on F.linear."""
    w = torch.randn(128, 2048, device="cuda").to(dtype)
    for rows in (1, 3, MAX_TOKENS):
        x = torch.randn(rows, 2048, device="cuda").to(dtype)
        assert mv.reads_float(x, w)  # else F.linear row by row would pass this test too
        got = mv.linear_each_row(x, w)
        assert torch.equal(got, matvec(w.view(torch.uint8), FLOAT_QTYPES[dtype], 128, x))
        ref = x.float() @ w.float().T
        assert got.dtype == dtype and float((got.float() - ref).abs().max() / ref.abs().max()) < tol
        assert all(torch.equal(got[i : i + 1], mv.linear_each_row(x[i : i + 1], w)) for i in range(rows))
    x = torch.randn(MAX_TOKENS + 1, 2048, device="cuda").to(dtype)
    assert torch.equal(mv.linear_each_row(x, w), torch.nn.functional.linear(x, w))


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
    x = torch.randn(MAX_TOKENS, D, device="cuda", dtype=torch.bfloat16)
    together = mv.matvecs(parts, x)
    for (raw, qtype, n_out), y in zip(parts, together, strict=True):
        alone = matvec(raw, qtype, n_out, x)
        assert y.shape == (x.shape[0], n_out)
        assert float((y.float() - alone.float()).abs().max() / alone.float().abs().max()) < 1e-2, qtype.name
    for i in range(x.shape[0]):
        row = mv.matvecs(parts, x[i : i + 1])
        assert all(torch.equal(a[i : i + 1], b) for a, b in zip(together, row, strict=True)), f"row {i}"


@pytest.mark.gpu
@gpu_or_interpreter
def test_matrices_with_and_without_lookup_tables_in_one_launch():
    """matvecs passes each part its own table (IQ1_M's grid, none for Q4_K, IQ3_XXS's grid and signs)."""
    rng = np.random.default_rng(5)
    D, parts, refs = 256, [], []
    for qtype, n_out in ((Q.IQ1_M, 24), (Q.Q4_K, 16), (Q.IQ3_XXS, 9)):
        stored = quantize(rng.standard_normal((n_out, D)).astype(np.float32), qtype)
        parts.append((torch.from_numpy(stored).to(DEVICE), qtype, n_out))
        refs.append(quants.dequantize(torch.from_numpy(stored), qtype, (n_out, D)))
    x = torch.randn(2, D)
    for y, w in zip(mv.matvecs(parts, x.to(DEVICE)), refs, strict=True):
        ref = x @ w.T
        assert float((y.cpu() - ref).abs().max() / ref.abs().max()) < 1e-5
