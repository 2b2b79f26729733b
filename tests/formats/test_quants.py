"""Torch dequantization must equal gguf's numpy reference bit for bit, on CPU and CUDA."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moestream.errors import MoestreamError
from moestream.formats.quants import SUPPORTED, TYPES, dequantize, get, row_bytes

Q = gguf.GGMLQuantizationType

# Byte offsets of the fp16 scale fields (d, dmin, m) inside one block: random bytes there would be NaN/inf.
F16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),
    Q.IQ2_XS: (0,),
    Q.IQ2_S: (0,),
    Q.IQ3_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.IQ1_S: (0,),
    Q.IQ1_M: (),  # its d is the top nibbles of its four 16-bit scale fields (set in random_bytes)
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,),
    Q.TQ2_0: (64,),
}
# Byte offsets of E8M0 exponents: random ones would reach 2**127 and overflow (edge exponents: their own test)
E8M0_FIELDS = {Q.MXFP4: (0,)}
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}

# 1-D, 2-D and a 3-D expert stack; every row is a whole number of 256-element super-blocks.
SHAPES = [(256,), (5, 512), (3, 4, 768)]


def random_bytes(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype` for a tensor of `shape`, as uint8 [..., row_bytes], with finite scales.

    Float types get random finite values: torch quiets signalling NaNs when widening F16 and numpy does not.
    """
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    magnitude = 10.0 ** rng.uniform(-3, 1, size=n_blocks)
    if qtype in FLOAT_TYPES:
        raw = (rng.standard_normal(n_blocks) * magnitude).astype(FLOAT_TYPES[qtype]).view(np.uint8)
    elif qtype == Q.BF16:
        raw = gguf.quants.quantize((rng.standard_normal(n_blocks) * magnitude).astype(np.float32), qtype)
    else:
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for offset in F16_FIELDS.get(qtype, ()):
            scale = (rng.standard_normal(n_blocks) * magnitude).astype(np.float16)
            raw[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        for offset in E8M0_FIELDS.get(qtype, ()):
            raw[:, offset] = rng.integers(127 - 30, 127 + 30, size=n_blocks)
        if qtype == Q.IQ1_M:
            d = (rng.standard_normal(n_blocks) * magnitude).astype(np.float16).view(np.uint16)
            nibbles = ((d[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 15).astype(np.uint8)
            raw[:, 49:56:2] = (raw[:, 49:56:2] & 0x0F) | (nibbles << 4)
    return raw.reshape(*shape[:-1], row_bytes(qtype, shape[-1]))


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(want)).reshape(shape)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Compare the float32 bit patterns (stricter than ==: also tells -0 from +0)."""
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    got = got.cpu()
    same = torch.equal(got.view(torch.int32), want.view(torch.int32))
    n_diff, max_diff = int((got != want).sum()), float((got - want).abs().max())
    assert same, f"{what}: {n_diff} elements differ, max |diff| {max_diff:.3g}"


def test_supported_types():
    expected = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K MXFP4".split()
    expected += "IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M IQ4_NL IQ4_XS TQ1_0 TQ2_0".split()
    assert {t.name for t in SUPPORTED} == set(expected)


def test_each_entry_names_its_type_and_the_kernels_it_has():
    """One entry a type, its layout gguf's; the kernel names are resolved (and checked) in kernels/types.py."""
    assert set(TYPES) == SUPPORTED
    for qtype, entry in TYPES.items():
        assert entry.qtype == qtype and (entry.block, entry.type_size) == gguf.GGML_QUANT_SIZES[qtype]
    assert get(Q.Q4_K).dot == "q4_k_dot" and get(Q.Q8_0).tile == "q8_0_tile"
    with pytest.raises(MoestreamError, match=r"tensor type Q8_K is not supported \(supported: .*Q6_K"):
        get(Q.Q8_K)


def test_random_blocks_have_finite_values():
    for qtype in SUPPORTED:
        raw = random_bytes(qtype, (3, 4, 768))
        assert np.isfinite(gguf.quants.dequantize(raw, qtype)).all(), qtype.name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda t: t.name)
def test_bit_exact_vs_gguf(qtype, shape):
    raw = random_bytes(qtype, shape)
    want = reference(raw, qtype, shape)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bit_exact(got, want, f"{qtype.name} {shape}")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's product reaching inf
def test_mxfp4_every_code_at_the_edge_exponents():
    """Every E2M1 code pair (all 256 bytes) under the E8M0 exponents at both ends (0 and 1 scale subnormals,
    255 overflows 8 and 12 to inf) and around 127 (a scale of 1)."""
    exponents = [0, 1, 2, 3, 125, 126, 127, 128, 129, 252, 253, 254, 255]
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    raw = np.zeros((len(exponents), 16, 17), np.uint8)
    raw[:, :, 0] = np.array(exponents, np.uint8)[:, None]
    raw[:, :, 1:] = codes
    shape = (len(exponents), 16 * 32)
    raw = raw.reshape(len(exponents), -1)
    want = reference(raw, Q.MXFP4, shape)
    assert torch.isinf(want[-1]).any() and (want[0] != 0).any()  # both ends reached
    assert_bit_exact(dequantize(torch.from_numpy(raw), Q.MXFP4, shape), want, "MXFP4 edge exponents")


@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda t: t.name)
def test_half_outputs_are_the_float32_result_cast(qtype):
    shape = (3, 4, 768)
    raw = torch.from_numpy(random_bytes(qtype, shape, seed=1))
    full = dequantize(raw, qtype, shape)
    for dtype in (torch.bfloat16, torch.float16):
        got = dequantize(raw, qtype, shape, dtype)
        assert got.dtype == dtype and got.shape == shape
        assert torch.equal(got, full.to(dtype)), f"{qtype.name} -> {dtype}"


def test_raw_may_be_flat_or_any_shape_of_the_right_size():
    shape = (3, 4, 768)
    raw = torch.from_numpy(random_bytes(Q.Q4_K, shape))
    want = dequantize(raw, Q.Q4_K, shape)
    assert torch.equal(dequantize(raw.reshape(-1), Q.Q4_K, shape), want)
    assert torch.equal(dequantize(raw.reshape(-1, 144), Q.Q4_K, shape), want)
    padded = torch.cat([raw.reshape(12, -1), torch.zeros(12, 7, dtype=torch.uint8)], dim=1)
    assert torch.equal(dequantize(padded[:, :-7], Q.Q4_K, shape), want), "rows that are not contiguous"


def test_chunked_expansion_matches_one_pass(monkeypatch):
    """Tensors bigger than one step are expanded in pieces; the pieces must line up."""
    from moestream.formats.quants import reference as torch_reference

    shape = (4, 8, 1024)
    raw = torch.from_numpy(random_bytes(Q.Q6_K, shape))
    monkeypatch.setattr(torch_reference, "_CHUNK_ELEMENTS", {"cpu": 3 * 256})
    got = dequantize(raw, Q.Q6_K, shape)
    assert_bit_exact(got, reference(raw.numpy(), Q.Q6_K, shape), "Q6_K in steps of 3 blocks")


def test_unsupported_type_is_named():
    raw = torch.zeros(row_bytes(Q.Q8_K, 256), dtype=torch.uint8)
    with pytest.raises(MoestreamError, match=r"tensor type Q8_K is not supported \(supported: .*Q4_K"):
        dequantize(raw, Q.Q8_K, (256,))


def test_wrong_byte_count_is_an_error():
    raw = torch.zeros(row_bytes(Q.Q4_K, 512) - 1, dtype=torch.uint8)
    with pytest.raises(MoestreamError, match="needs 288 bytes, got 287"):
        dequantize(raw, Q.Q4_K, (512,))
    with pytest.raises(MoestreamError, match="a row of 100 is not a whole number of Q4_K blocks of 256"):
        row_bytes(Q.Q4_K, 100)


def test_row_bytes():
    assert row_bytes(Q.Q4_K, 2048) == 8 * 144
    assert row_bytes(Q.Q8_0, 64) == 68
    assert row_bytes(Q.F16, 10) == 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda t: t.name)
def test_bit_exact_vs_gguf_on_cuda(qtype):
    for shape in SHAPES:
        raw = random_bytes(qtype, shape)
        got = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
        assert got.device.type == "cuda"
        assert_bit_exact(got, reference(raw, qtype, shape), f"{qtype.name} {shape} on cuda")
        half = dequantize(torch.from_numpy(raw).cuda(), qtype, shape, torch.bfloat16)
        assert torch.equal(half, got.to(torch.bfloat16)), f"{qtype.name} {shape} -> bf16 on cuda"
