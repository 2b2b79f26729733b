"""The IQ grid types' torch reference against gguf's on edge patterns: every grid row, every sign pattern,
every scale field with zero, negative, subnormal and overflowing d, IQ1's deltas of both signs. Blocks are
written from their fields (grid_quantize.pack), and the values are also checked against the fields read
straight through gguf's grid, so the patterns are what they claim to be."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moestream.formats.grid_quantize import SPECS, Fields, pack
from moestream.formats.quants import dequantize
from moestream.formats.quants.grids import grid_values, kernel_table, sign_bytes

Q = gguf.GGMLQuantizationType
GRID_TYPES = list(SPECS)
KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
PARITY = {Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS}  # 7-bit sign indices: even-parity patterns only
IQ1 = {Q.IQ1_S, Q.IQ1_M}
N_SCALES = {Q.IQ2_XXS: 8, Q.IQ2_XS: 16, Q.IQ2_S: 16, Q.IQ3_XXS: 8, Q.IQ3_S: 8, Q.IQ1_S: 8, Q.IQ1_M: 16}
N_DELTAS = {Q.IQ1_S: 8, Q.IQ1_M: 32}


def random_fields(qtype: Q, n: int, rng: np.random.Generator) -> Fields:
    """n blocks of random valid fields, d in [0.5, 2)."""
    width = grid_values(qtype).shape[1]
    d = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    scales = rng.integers(0, SPECS[qtype].scale_max + 1, (n, N_SCALES[qtype]), dtype=np.uint8)
    index = rng.integers(0, len(grid_values(qtype)), (n, 256 // width))
    if qtype in IQ1:
        signs = rng.integers(0, 2, (n, N_DELTAS[qtype]), dtype=np.uint8)
    elif qtype in PARITY:
        signs = KSIGNS[rng.integers(0, 128, (n, 32))]
    else:
        signs = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    return Fields(d, scales, index, signs)


def expected(qtype: Q, f: Fields) -> np.ndarray:
    """The values fields stand for, in gguf's order of float32 products, from gguf's grid."""
    n = len(f.d)
    d = f.d.astype(np.float16).astype(np.float32)[:, None]
    s = f.scales.astype(np.float32)
    if qtype in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S):
        db = d * (np.float32(0.5) + s) * np.float32(0.25)
    elif qtype == Q.IQ3_XXS:
        db = d * (np.float32(0.5) + s) * np.float32(0.5)
    else:
        db = d * (np.float32(1) + np.float32(2) * s)
    db = db.repeat(256 // s.shape[1], axis=1)
    values = grid_values(qtype)[f.index].reshape(n, 256)
    if qtype in IQ1:
        delta = np.where(f.signs == 0, np.float32(0.125), np.float32(-0.125)).repeat(256 // f.signs.shape[1], axis=1)
        return db * (values + delta)
    bits = np.unpackbits(f.signs[..., None], axis=-1, bitorder="little").reshape(n, 256)
    return db * values * np.where(bits == 0, np.float32(1), np.float32(-1))


def check(qtype: Q, f: Fields) -> None:
    raw = pack(qtype, f)
    want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(len(raw), 256)
    got = dequantize(torch.from_numpy(raw), qtype, want.shape).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), f"{qtype.name}: ours differs from gguf"
    assert np.array_equal(expected(qtype, f).view(np.int32), want.view(np.int32)), f"{qtype.name}: fields misread"


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_every_grid_row(qtype):
    rows, width = grid_values(qtype).shape
    n = rows * width // 256
    f = random_fields(qtype, n, np.random.default_rng(1))
    check(qtype, Fields(f.d, f.scales, np.arange(rows).reshape(n, -1), f.signs))


@pytest.mark.parametrize("qtype", [t for t in GRID_TYPES if t not in IQ1], ids=lambda t: t.name)
def test_every_sign_pattern(qtype):
    patterns = KSIGNS if qtype in PARITY else np.arange(256, dtype=np.uint8)
    f = random_fields(qtype, len(patterns) // 32, np.random.default_rng(2))
    check(qtype, Fields(f.d, f.scales, f.index, patterns.reshape(-1, 32)))


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_every_scale_with_zero_negative_tiny_and_huge_d(qtype):
    """Each d with every scale field value; 65504 times the largest multipliers overflows to inf, as in gguf."""
    ds = np.array([0.0, -0.0, 1.0, -1.5, 2.0**-24, -(2.0**-14), 65504.0, -65504.0], np.float32)
    f = random_fields(qtype, len(ds), np.random.default_rng(3))
    scales = np.resize(np.arange(SPECS[qtype].scale_max + 1, dtype=np.uint8), f.scales.shape)
    check(qtype, Fields(ds, scales, f.index, f.signs))


@pytest.mark.parametrize("qtype", sorted(IQ1), ids=lambda t: t.name)
def test_iq1_deltas_of_both_signs(qtype):
    f = random_fields(qtype, 4, np.random.default_rng(4))
    for negative in (np.zeros_like(f.signs), np.ones_like(f.signs), f.signs):
        check(qtype, Fields(f.d, f.scales, f.index, negative))


def test_the_tables_come_from_gguf():
    """The grids are gguf's objects; sign rows 256.. are its 7-bit patterns (bit j set: element j negative)."""
    for qtype in GRID_TYPES:
        cls = getattr(gguf.quants, qtype.name)
        assert np.array_equal(grid_values(qtype), cls.grid.reshape(cls.grid_shape))
    signs = sign_bytes(torch.device("cpu")).numpy()
    bits = np.unpackbits(KSIGNS[:, None], axis=-1, bitorder="little")
    assert np.array_equal(signs[256:], np.where(bits == 1, -1, 1))
    assert signs.shape == (384, 8)


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_kernel_table_words(qtype):
    """The kernels' table is the grid rows' values as bfloat16 pairs, low half first."""
    table = kernel_table(qtype, torch.device("cpu")).numpy().view(np.uint32)
    grid = grid_values(qtype)
    halves = np.stack([table & 0xFFFF, table >> 16], axis=-1).reshape(grid.shape)
    assert np.array_equal((halves.astype(np.uint32) << 16).view(np.float32), grid)
