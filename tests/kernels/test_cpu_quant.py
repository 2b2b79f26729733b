"""The compiled CPU matvec against dequantize-then-multiply, and its half-float decoding for every value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from block_patterns import F16_FIELDS, bit_patterns
from gguf import GGMLQuantizationType as Q
from grid_patterns import GRID_TYPES, grid_blocks

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler")


def test_the_types_are_those_formats_names_a_c_block_function_for():
    source = cpu_quant.SOURCE.read_text()
    for qtype in cpu_quant.TYPES:
        assert f"static void {quants.get(qtype).cpu_dot}(const uint8_t *b, float *out)" in source, qtype.name
    assert cpu_quant.TYPES == set(F16_FIELDS) | {Q.Q4_K, Q.Q6_K} | set(GRID_TYPES)


@pytest.mark.parametrize("qtype", sorted(cpu_quant.TYPES))
def test_matvec_matches_dequantized_product(qtype):
    w = (np.random.default_rng(0).standard_normal((6, 40, 768)) * 0.05).astype(np.float32)
    raw = torch.from_numpy(quantize(w, qtype))
    W = quants.dequantize(raw, qtype, w.shape, torch.float32)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    mats = torch.tensor([5, 0, 5, 2, 3])
    ref = torch.einsum("pod,pd->po", W[mats], x)
    got = cpu_quant.matvec(raw, qtype, 40, x, mats)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    one = cpu_quant.matvec(raw[4], qtype, 40, x)
    assert float((one - x @ W[4].T).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS), ids=lambda t: t.name)
def test_block_functions_read_every_bit_pattern(qtype):
    rng = np.random.default_rng(5)
    stored = bit_patterns(rng, qtype, (3, 40), 768)
    W = quants.dequantize(torch.from_numpy(stored), qtype, (3, 40, 768), torch.float64)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(2))
    mats = torch.tensor([2, 0, 2])
    ref = torch.einsum("pod,pd->po", W[mats], x.double())
    got = cpu_quant.matvec(torch.from_numpy(stored), qtype, 40, x, mats)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_grid_block_functions_give_the_reference_bits(qtype):
    """Over every grid row, sign pattern and scale (iq_grids.h generated from gguf's tables): x = the identity
    makes each output one stored value times 1 plus zeros, so the C blocks must equal the reference exactly."""
    raw = torch.from_numpy(grid_blocks(qtype, 64))  # 64 rows of one block
    W = quants.dequantize(raw, qtype, (64, 256))
    got = cpu_quant.matvec(raw, qtype, 64, torch.eye(256))
    assert torch.equal(got, W.T), f"{int((got != W.T).sum())} values differ"


def test_every_half_float_scale_decodes_exactly():
    """Q8_0 blocks whose scale runs through all 65536 half floats, each with quants of 1: out = the scale."""
    halves = np.arange(65536, dtype=np.uint16)
    blocks = np.zeros((65536, 34), dtype=np.uint8)
    blocks[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = 1
    got = cpu_quant.matvec(torch.from_numpy(blocks), Q.Q8_0, 65536, torch.full((1, 32), 1 / 32))[0].numpy()
    want = halves.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite], want[finite])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))


def test_int8_types_are_those_the_c_file_unpacks():
    lib = cpu_quant._library()
    assert {q for q in cpu_quant.TYPES if lib.int8_offset(int(q)) >= 0} == cpu_quant.INT8_TYPES


def representable(rows: int, n: int, seed: int) -> torch.Tensor:
    """x whose int8 rounding is exact: integers up to 127 (each 32 holding a 127) times a power of two a 32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, n // 32, 32), generator=g)
    q[:, :, 5] = 127 * (1 - 2 * torch.randint(0, 2, (rows, n // 32), generator=g))
    scale = 2.0 ** torch.randint(-12, -4, (rows, n // 32, 1), generator=g)
    return (q * scale).reshape(rows, n).float()


@pytest.mark.parametrize("qtype", sorted(cpu_quant.INT8_TYPES), ids=lambda t: t.name)
def test_int8_matvec_is_exact_where_x_rounds_exactly(qtype):
    """Every stored bit pattern through the integer unpacks: with x that int8 holds exactly, the integer
    products and the scales must give the float product of the dequantized weights."""
    stored = torch.from_numpy(bit_patterns(np.random.default_rng(7), qtype, (3, 40), 768))
    W = quants.dequantize(stored, qtype, (3, 40, 768), torch.float64)
    x = representable(3, 768, 3)
    mats = torch.tensor([2, 0, 2])
    ref = torch.einsum("pod,pd->po", W[mats], x.double())
    got = cpu_quant.matvec(stored, qtype, 40, x, mats, int8=True)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("qtype", sorted(cpu_quant.INT8_TYPES), ids=lambda t: t.name)
def test_int8_matvec_rounds_x_like_a_q8_block(qtype):
    """Any x: within int8 rounding of the float product (and not equal to it: the rounding happened)."""
    w = (np.random.default_rng(0).standard_normal((6, 40, 768)) * 0.05).astype(np.float32)
    raw = torch.from_numpy(quantize(w, qtype))
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    mats = torch.tensor([5, 0, 5, 2, 3])
    ref = cpu_quant.matvec(raw, qtype, 40, x, mats)
    err = float((cpu_quant.matvec(raw, qtype, 40, x, mats, int8=True) - ref).abs().max() / ref.abs().max())
    assert 1e-5 < err < 2e-2


def test_a_build_started_in_the_background_is_the_one_callers_wait_for(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh machine's cache: the C file compiles
    monkeypatch.setattr(cpu_quant, "_loaded", {})
    builds, real = [], cpu_quant._built
    monkeypatch.setattr(cpu_quant, "_built", lambda: builds.append(True) or real())
    cpu_quant.build_in_background()
    assert cpu_quant.available() and cpu_quant.available()
    assert len(builds) == 1 and list((tmp_path / "moestream").glob("cpu_quant-*.so"))
