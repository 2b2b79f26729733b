"""The generator's quantizers: valid bytes (gguf's reader agrees with ours) and bounded round-trip error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moestream.errors import MoestreamError
from moestream.formats.quantize import QUANTIZABLE, _extremes, quantize
from moestream.formats.quants import SUPPORTED, dequantize, row_bytes

Q = gguf.GGMLQuantizationType

# Relative RMS error bounds, ||dequantize(quantize(x)) - x|| / ||x||, on standard gaussian rows. A uniform
# quantizer errs by step/sqrt(12); with min/max scales over a sub-block of 32 (range ~4.1 sigma) or 16
# (~3.5 sigma) gaussians that gives the numbers measured in the comments (seed 0, 64 x 4096 values);
# each bound leaves ~15% margin. Q2_K cannot get near 0.1: 2-bit codes on gaussian data sit above ~0.25
# whatever the scales (rate-distortion), and plain min/max scales reach 0.33.
REL_RMS_BOUND = {
    Q.F32: 0.0,  # exact
    Q.F16: 3e-4,  # measured 2.1e-4: 11-bit mantissa, 2^-11 / sqrt(12) * ~1.2 for the gaussian's spread
    Q.BF16: 2.5e-3,  # measured 1.7e-3: 8-bit mantissa
    Q.Q8_0: 7e-3,  # measured 5.4e-3: absmax / 127 step over 32
    Q.Q4_0: 0.10,  # measured 0.086: absmax / 8 step over 32 (gguf's quantizer)
    Q.Q4_1: 0.09,  # measured 0.078: (max - min) / 15 step over 32 (gguf's quantizer)
    Q.Q5_0: 0.05,  # measured 0.043: absmax / 16 step over 32 (gguf's quantizer)
    Q.Q5_1: 0.045,  # measured 0.038: (max - min) / 31 step over 32 (gguf's quantizer)
    Q.Q2_K: 0.36,  # measured 0.328: (max - min) / 3 step over 16, 4-bit scales and mins
    Q.Q3_K: 0.18,  # measured 0.155: absmax / 4 step over 16, 6-bit signed scales
    Q.Q4_K: 0.09,  # measured 0.078: (max - min) / 15 step over 32, 6-bit scales and mins
    Q.Q5_K: 0.045,  # measured 0.038: (max - min) / 31 step over 32, 6-bit scales and mins
    Q.Q6_K: 0.022,  # measured 0.0188: absmax / 32 step over 16, 8-bit signed scales
    Q.MXFP4: 0.13,  # measured 0.115: E2M1 codes, a power-of-two scale over 32 (gguf's choice)
    Q.IQ4_NL: 0.09,  # measured 0.080: 16 non-linear values, the block's absmax on -127, over 32
    Q.IQ4_XS: 0.09,  # measured 0.080: the same, with 6-bit sub-block scales of one fp16 d over 256
    Q.TQ1_0: 0.85,  # measured 0.807: -1, 0 or 1 times the absmax over 256 (gguf's quantizer; fits ternary weights)
    Q.TQ2_0: 0.85,  # measured 0.807: TQ1_0's values, 2 bits each
    # The grid types: absmax onto the grid's largest value per scale group, then the nearest grid row
    Q.IQ2_XXS: 0.42,  # measured 0.363: 3 magnitudes, 256 rows of 8, even-parity signs, a scale per 32
    Q.IQ2_XS: 0.36,  # measured 0.312: 512 rows, a scale per 16
    Q.IQ2_S: 0.31,  # measured 0.266: 1024 rows, free signs, a scale per 16
    Q.IQ3_XXS: 0.22,  # measured 0.188: 8 magnitudes, 256 rows of 4, even-parity signs
    Q.IQ3_S: 0.16,  # measured 0.138: 512 rows of 4, free signs
    Q.IQ1_S: 0.67,  # measured 0.586: -1, 0, 1 shifted by +-1/8, 2048 rows of 8, a scale per 32
    Q.IQ1_M: 0.58,  # measured 0.501: a scale per 16, a shift per 8
}


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def ours(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return dequantize(torch.from_numpy(raw), qtype, shape).numpy()


def test_every_supported_type_can_be_written():
    assert QUANTIZABLE == SUPPORTED
    assert set(REL_RMS_BOUND) == SUPPORTED


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE), ids=lambda t: t.name)
def test_round_trip_error_is_bounded(qtype):
    x = gaussian((64, 4096))
    raw = quantize(x, qtype)
    y = ours(raw, qtype, x.shape)
    rel = float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))
    max_abs = float(np.abs(y - x).max())
    bound = REL_RMS_BOUND[qtype]
    assert rel <= bound, f"{qtype.name}: relative RMS error {rel:.4g} > {bound} (max |error| {max_abs:.4g})"


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE), ids=lambda t: t.name)
def test_bytes_read_the_same_with_gguf(qtype):
    """Our bytes are a valid encoding: gguf's own numpy decoder and ours agree bit for bit on them."""
    shape = (3, 4, 768)
    # Sub-blocks of very different magnitudes and signs exercise the scale and min fields.
    magnitude = np.float32(10.0) ** gaussian((3, 4, 24, 1), seed=2)
    x = gaussian(shape, seed=1) * magnitude.repeat(32, axis=-1).reshape(shape)
    x[0, 0, :256] = np.abs(x[0, 0, :256])
    x[0, 1, :256] = -np.abs(x[0, 1, :256])
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (3, 4, row_bytes(qtype, 768))
    theirs = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
    mine = ours(raw, qtype, shape)
    assert np.array_equal(theirs.view(np.int32), mine.view(np.int32)), (
        f"{qtype.name}: max |gguf - ours| {np.abs(theirs - mine).max():.3g}"
    )
    # One-signed blocks leave part of an affine code's range unused: measured up to 1.1x the gaussian error.
    rel = np.sqrt(np.mean((mine - x) ** 2) / np.mean(x**2))
    bound = 1.25 * REL_RMS_BOUND[qtype]
    assert rel <= bound, f"{qtype.name}: relative RMS error {rel:.4g} > {bound:.3g} on mixed magnitudes"


def test_mxfp4_bytes_are_those_gguf_writes():
    """Our MXFP4 quantizer is gguf's, faster: the same bytes over 60 decades of block magnitudes, and on values
    exactly halfway between two codes (a tie takes the smaller magnitude) or beyond the largest."""
    rng = np.random.default_rng(3)
    magnitude = (np.float32(10.0) ** rng.uniform(-30, 30, (64, 128, 1))).astype(np.float32)
    x = gaussian((64, 128, 32), seed=4) * magnitude
    halfway = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, 11, 12, 13, 0.25, 0, -0.0, 15.9], np.float32) / 8
    x[0, :, : len(halfway)] = halfway * rng.choice([-1, 1], (128, len(halfway)))
    x[0, :, len(halfway)] = 2.0 * rng.choice([-1, 1], 128)  # the block's largest: a scale of 2**-2
    x = x.reshape(64, 4096)
    assert np.array_equal(quantize(x, Q.MXFP4), gguf.quants.quantize(x, Q.MXFP4))


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE), ids=lambda t: t.name)
def test_zeros_stay_zeros(qtype):
    x = np.zeros((2, 512), np.float32)
    y = ours(quantize(x, qtype), qtype, x.shape)
    assert not np.abs(y).any(), f"{qtype.name}: max |error| {np.abs(y).max():.3g}"


def test_unsupported_type_is_named():
    with pytest.raises(MoestreamError, match=r"cannot quantize to Q8_K \(supported: .*Q4_K"):
        quantize(gaussian((256,)), Q.Q8_K)


def test_row_must_be_whole_blocks():
    with pytest.raises(MoestreamError, match="not a whole number of Q4_K blocks"):
        quantize(gaussian((2, 100)), Q.Q4_K)


@pytest.mark.parametrize("shape", [(5, 8, 32), (3, 16), (7, 2, 16, 1)])
def test_extremes_by_halving_equal_numpys_reductions(shape):
    xs = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    xs.reshape(-1)[::7] = -0.0
    lo, hi = _extremes(xs)
    assert np.array_equal(lo, xs.min(axis=-1)) and np.array_equal(hi, xs.max(axis=-1))
