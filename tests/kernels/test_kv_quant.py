"""KV rows as Q8_0 / Q4_0 blocks: bit-exact with gguf.quants.quantize (torch form, and the Triton kernel on
CUDA or in Triton's interpreter), and dequantized as gguf dequantizes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from kernel_devices import DEVICE, gpu_or_interpreter

from moestream.errors import MoestreamError
from moestream.kernels import kv_quant
from moestream.options import Options

TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


def rows(n: int = 7, c: int = 256) -> torch.Tensor:
    """Random rows with the cases rounding cares about: a zero block, ties of magnitude of either sign (the
    first one positive, then negative: the sign of q4_0's scale), values exactly half-way between steps (q8_0
    rounds them away from zero, q4_0 truncates x / d + 8.5), and a large range."""
    torch.manual_seed(0)
    x = torch.randn(n, c) * torch.logspace(-3, 3, n)[:, None]
    x[0, :32] = 0
    x[1, :32] = torch.tensor([1.0, -1.0] * 16)  # q4_0's argmax takes the first of equal magnitudes
    x[2, :32] = torch.arange(32) - 15.5  # steps of one at a scale of 127 / 16
    x[3, 32:64] = 127 * (torch.arange(32) % 5 - 2) / 254  # halves: round half away from zero
    x[4, :32] = torch.tensor([-8.0] + [j % 16 - 7.5 for j in range(31)])  # q4_0: d = 1, every x / d a half
    return x


@pytest.mark.parametrize("name", TYPES)
def test_torch_form_is_bit_exact_with_gguf(name):
    x = rows()
    want = quants.quantize(x.numpy(), TYPES[name])
    got = kv_quant.quantize_torch(x, name)
    assert got.shape == want.shape
    assert np.array_equal(got.numpy(), want), f"{(got.numpy() != want).sum()} bytes differ"
    back = kv_quant.dequantize(got, name, torch.float32)
    assert torch.equal(back, torch.from_numpy(quants.dequantize(want, TYPES[name])))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_other_dtypes_quantize_as_their_float32_values(name, dtype):
    x = rows(5, 64).to(dtype)
    want = quants.quantize(x.float().numpy(), TYPES[name])
    assert np.array_equal(kv_quant.quantize(x, name).numpy(), want)


@gpu_or_interpreter
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", [9, 8])
def test_triton_kernel_is_bit_exact_with_gguf(name, n):
    """9 rows: 36 blocks, three programs, the last one partial; 8: 32 blocks, two whole ones. Scales above and
    below 1 (a byte store of the f16 scale once compiled to a float-to-u8 conversion on sm_90: 0 below 1)."""
    x = rows(n, 128)
    want = quants.quantize(x.numpy(), TYPES[name])
    got = kv_quant.quantize_kernel(x.to(DEVICE), name).cpu()
    assert np.array_equal(got.numpy(), want), f"{(got.numpy() != want).sum()} bytes differ"


def test_bad_types_and_shapes_are_clear_errors():
    with pytest.raises(MoestreamError, match="--cache-type-k q5_1: expected one of f32, f16, bf16, q8_0, q4_0"):
        Options.check(cache_type_k="q5_1")
    assert Options.make(device="cpu", cache_type_v="Q8_0").model.kv_types == ("f32", "q8_0")
    with pytest.raises(MoestreamError, match="multiple of 32 values; this model's are 40"):
        kv_quant.row_bytes("q4_0", 40)
    assert kv_quant.row_bytes("q8_0", 64) == 68 and kv_quant.row_bytes("q4_0", 64) == 36
    assert kv_quant.row_bytes("bf16", 64) == 128
