"""The block dots (through the matvec) over every bit pattern of their types, against the dequantized product,
and the dot tables against the names formats/quants gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from block_patterns import F16_FIELDS, bit_patterns
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from grid_patterns import GRID_TYPES, grid_blocks
from kernel_devices import DEVICE, as_kernel_rounds, gpu_or_interpreter

from moestream.formats import quants
from moestream.kernels import dots
from moestream.kernels.matvec import matvec


@pytest.mark.skipif(dots.triton is None, reason="needs Triton")
def test_the_tables_hold_the_dots_formats_names():
    named = {t.qtype: t.dot for t in quants.TYPES.values() if t.dot}
    assert {q: d.fn.__name__ for q, d in (dots.DOTS | dots.FLOAT_DOTS).items()} == named
    assert set(dots.FLOAT_DOTS) == set(dots.FLOAT_QTYPES.values())


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
    """Rows of qtype over all its bit patterns, as the functions above, grid_patterns or block_patterns make
    them."""
    if qtype in GRID_TYPES:
        n_blocks = int(np.prod(rows)) * n_in // 256
        return grid_blocks(qtype, n_blocks, int(rng.integers(1 << 16))).reshape(*rows, -1)
    if qtype == Q.Q6_K:
        return _q6_k_bit_patterns(rng, rows, n_in)
    if qtype in (Q.Q4_K, Q.Q5_K):
        return _k_bit_patterns(rng, rows, n_in, {Q.Q4_K: 144, Q.Q5_K: 176}[qtype])
    return bit_patterns(rng, qtype, rows, n_in)


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
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("n_in", [512, 2048])  # 2 and 8 blocks a row (a row of 8 is unrolled)
def test_grid_dots_read_every_row_sign_and_scale(qtype, n_in, stacked):
    """The IQ grid dots (table lookups, signs XORed into bfloat16 pairs, IQ1's delta times the sum of x) against
    the dequantized product, in float32, over every grid row, sign pattern and scale field."""
    rng = np.random.default_rng(8)
    stored = _bit_patterns(rng, qtype, (4, 19) if stacked else (19,), n_in)
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
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize(
    "qtype,n_blocks",
    # 32-value blocks: one at a time (rows off word boundaries), a tile of 8, two tiles; super-blocks: 1 and 3
    [(q, n) for q in sorted(F16_FIELDS) for n in ((3, 8, 16) if GGML_QUANT_SIZES[q][0] == 32 else (1, 3))],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_dots_read_every_bit_pattern(qtype, n_blocks, stacked):
    """The other types' dots against the dequantized product, in float32, over all their bit patterns."""
    n_in = n_blocks * GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(8)
    stored = bit_patterns(rng, qtype, (3, 19) if stacked else (19,), n_in)  # 19: a partial tile
    W = quants.dequantize(torch.from_numpy(stored), qtype, (*stored.shape[:-1], n_in), torch.float32).double()
    raw = torch.from_numpy(stored).to(DEVICE)
    x = torch.randn(2, n_in, generator=torch.Generator().manual_seed(n_in))
    if stacked:
        mats = torch.tensor([2, 0])
        got = matvec(raw, qtype, 19, x.to(DEVICE), mats.to(DEVICE)).cpu()
        ref = torch.einsum("pod,pd->po", W[mats], x.double())
    else:
        got = matvec(raw, qtype, 19, x.to(DEVICE)).cpu()
        ref = x.double() @ W.T
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.gpu
@gpu_or_interpreter
@pytest.mark.parametrize(
    "qtype,n_in",
    [(Q.Q4_K, 2048), (Q.Q5_K, 2048), (Q.Q6_K, 2048)] + [(q, 512) for q in (*sorted(F16_FIELDS), *GRID_TYPES)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_a_bfloat16_x_read_packed_gives_the_bits_of_reading_it_as_float32(qtype, n_in):
    """The dots read a bfloat16 x 4 (Q6_K and the grid types: 2) values a load and take each apart by shifts:
    the float32 sums must be those of the same values read one by one as float32, so the rounded results are
    equal."""
    rng = np.random.default_rng(7)
    stored = _bit_patterns(rng, qtype, (4, 19), n_in)
    raw = torch.from_numpy(stored).to(DEVICE)
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    mats = torch.tensor([3, 0, 3], device=DEVICE)
    for picks in (None, mats):
        packed = matvec(raw, qtype, 19, x, picks)
        assert packed.dtype == torch.bfloat16
        assert torch.equal(packed, as_kernel_rounds(matvec(raw, qtype, 19, x.float(), picks)))
