"""Triton dequantization against the torch reference (which is bit-exact with gguf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from block_patterns import F16_FIELDS, bit_patterns
from gguf import GGMLQuantizationType as Q
from grid_patterns import GRID_TYPES, grid_blocks
from kernel_devices import DEVICE, as_kernel_rounds, gpu_or_interpreter

from moestream.formats import quants
from moestream.formats.quantize import quantize
from moestream.kernels.dequant import TILES, dequantize, tiled
from moestream.kernels.launch import triton

EXACT_TILES = {Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.Q4_0, Q.Q5_0, Q.Q3_K}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_the_tiles_are_those_formats_names():
    assert {q: tile.fn.__name__ for q, tile in TILES.items()} == {
        t.qtype: t.tile for t in quants.TYPES.values() if t.tile
    }


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0])
def test_kernel_matches_reference(qtype):
    assert qtype in TILES
    x = (np.random.default_rng(0).standard_normal((6, 40, 512)) * 0.05).astype(np.float32)
    raw = torch.from_numpy(quantize(x, qtype)).cuda()
    ref = quants.dequantize(raw, qtype, x.shape, torch.float32)
    got = dequantize(raw, qtype, x.shape, torch.float32)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-6, f"{qtype.name}: {err:.2e}"
    ref16 = quants.dequantize(raw, qtype, x.shape, torch.bfloat16).float()
    got16 = dequantize(raw, qtype, x.shape, torch.bfloat16).float()
    assert float((got16 - ref16).abs().max() / ref16.abs().max()) < 1e-2
    assert float((got16 != ref16).float().mean()) < 1e-3  # only FMA-rounding ties may differ


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("qtype", sorted(F16_FIELDS), ids=lambda t: t.name)
def test_tiles_read_every_bit_pattern(qtype):
    """The other types' tiles against the reference over all their bit patterns: within float32 rounding (a
    tile may fuse a multiply and an add), bit for bit where a tile has no sum to fuse (EXACT_TILES)."""
    shape = (5, 3, 512)
    stored = torch.from_numpy(bit_patterns(np.random.default_rng(9), qtype, shape[:-1], shape[-1]))
    ref = quants.dequantize(stored, qtype, shape, torch.float32)
    got = tiled(stored.to(DEVICE), qtype, shape, torch.float32).cpu()
    if qtype in EXACT_TILES:
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), qtype.name
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6, qtype.name


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_grid_tiles_are_bit_exact(qtype):
    """The IQ grid tiles form the reference's products (one multiply by the scale of a signed grid value, or of
    grid value plus delta), so they match it bit for bit, over every grid row, sign pattern and scale."""
    raw = torch.from_numpy(grid_blocks(qtype, 70)).to(DEVICE)  # 70: a partial program of 8 blocks
    shape = (5, 14 * 256)
    ref = quants.dequantize(raw.cpu(), qtype, shape)
    got = tiled(raw, qtype, shape, torch.float32).cpu()
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"{int((got != ref).sum())} differ"
    assert torch.equal(tiled(raw, qtype, shape, torch.bfloat16).cpu(), as_kernel_rounds(ref))


def test_cpu_takes_the_reference_path():
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    raw = torch.from_numpy(quantize(x, Q.Q4_K))
    assert torch.equal(dequantize(raw, Q.Q4_K, x.shape), quants.dequantize(raw, Q.Q4_K, x.shape))
