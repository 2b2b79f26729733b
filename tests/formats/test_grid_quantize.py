"""The IQ grid quantizers: values already on a grid come back bit for bit (the search finds them), and the
parity rule keeps 7-bit sign patterns valid. Round-trip error bounds on gaussian rows are in test_quantize.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moestream.formats.grid_quantize import SPECS, Fields, fields_of, pack
from moestream.formats.quantize import quantize
from moestream.formats.quants import dequantize
from moestream.formats.quants.grids import grid_values

Q = gguf.GGMLQuantizationType
KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
IQ1_DELTAS = {Q.IQ1_S: 8, Q.IQ1_M: 32}  # shifts a block


def on_grid(qtype: Q, n: int, rng: np.random.Generator) -> Fields:
    """Random fields whose every scale group reaches the largest magnitude (IQ1: 9/8 of its scale) and whose
    every block has the largest scale field: the values such blocks hold have just one encoding."""
    spec, grid = SPECS[qtype], grid_values(qtype)
    rows_per_scale = spec.per_scale // spec.width
    d = rng.uniform(0.01, 2, n).astype(np.float16).astype(np.float32)
    scales = rng.integers(0, spec.scale_max + 1, (n, 256 // spec.per_scale), dtype=np.uint8)
    scales[:, 0] = spec.scale_max
    index = rng.integers(0, len(grid), (n, 256 // spec.width))
    if qtype in IQ1_DELTAS:
        signs = rng.integers(0, 2, (n, IQ1_DELTAS[qtype]), dtype=np.uint8)
        negative = signs.repeat(256 // signs.shape[1], axis=1)[:, :: spec.per_scale].astype(bool)
        peaks = np.where(negative, (grid == -1).any(axis=1).nonzero()[0][0], (grid == 1).any(axis=1).nonzero()[0][0])
    else:
        signs = KSIGNS[rng.integers(0, 128, (n, 32))] if spec.parity else rng.integers(0, 256, (n, 32), np.uint8)
        peaks = np.full(scales.shape, (grid == grid.max()).any(axis=1).nonzero()[0][0])
    index[:, ::rows_per_scale] = peaks
    return Fields(d, scales, index, signs)


@pytest.mark.parametrize("qtype", list(SPECS), ids=lambda t: t.name)
def test_values_on_the_grid_are_a_fixed_point(qtype):
    raw = pack(qtype, on_grid(qtype, 64, np.random.default_rng(0)))
    x = dequantize(torch.from_numpy(raw), qtype, (64, 256)).numpy()
    again = quantize(x, qtype)
    got = dequantize(torch.from_numpy(again), qtype, x.shape).numpy()
    assert np.array_equal(got.view(np.int32), x.view(np.int32)), f"{qtype.name}: {int((got != x).sum())} moved"
    assert np.array_equal(again, raw)


@pytest.mark.parametrize("qtype", [q for q, s in SPECS.items() if s.parity], ids=lambda t: t.name)
def test_an_odd_count_of_minus_signs_flips_the_smallest_magnitude(qtype):
    x = np.abs(np.random.default_rng(1).standard_normal((2, 256), dtype=np.float32)) + 0.5
    x[0, 3] = -x[0, 3]  # one minus sign in the first 8: odd
    x[0, 5] = 0.01  # the smallest magnitude there, which must take the wrong sign
    x[1, 8:10] *= -1  # two: even, kept
    signs = fields_of(qtype, x).signs
    assert signs[0, 0] == (1 << 3) | (1 << 5) and signs[1, 1] == 0b11
    assert np.isin(signs, KSIGNS).all()
