"""x times a dense weight, float or stored blocks: the head in slices equals the whole product, slices of a
quantized head equal the whole head dequantized at once, a stored weight gives the bits of its dequantized
copy where no matvec reads it, and a few tokens on the CPU read the stored blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.formats.gguf import GGUFFile, torch_bytes
from moestream.ops import linear as ops_linear
from moestream.ops.linear import Stored, head_logits, linear, linears, row_chunks, swiglu


def output_head(model_file, quant: str) -> torch.Tensor | Stored:
    """A generated model's output head as DenseWeights keeps it: float32, or its stored blocks."""
    v = GGUFFile(model_file("tiny", quant)).tensors["output.weight"]
    w = Stored(torch_bytes(v), v.qtype, v.shape)
    return w.dequantize(torch.float32) if quant == "F32" else w


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 7, 100, 10**6])
def test_row_chunks_equal_whole_weight(model_file, quant, rows):
    w = output_head(model_file, quant)
    whole = w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)
    chunks = list(row_chunks(w, rows, torch.float32))
    assert len(chunks) == -(-whole.shape[0] // rows)
    assert torch.equal(torch.cat(chunks), whole)


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_head_in_slices_equals_one_product(model_file, quant, monkeypatch):
    w = output_head(model_file, quant)
    dense = w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)
    x = torch.randn(9, dense.shape[1], generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(ops_linear, "HEAD_ROWS", 100)  # several slices of the tiny vocabulary
    assert torch.equal(head_logits(x, w), F.linear(x, dense))


@pytest.mark.parametrize("T", [5, 9])
def test_a_stored_weight_multiplies_as_its_dequantized_copy(model_file, T):
    """On the CPU, past a few tokens: the product is the dequantized weight's, row by row for a few rows as for
    a float weight (linears too, and the shared expert's gate and up)."""
    w = output_head(model_file, "Q4_K_M")
    dense = w.dequantize(torch.float32)
    x = torch.randn(T, dense.shape[1], generator=torch.Generator().manual_seed(1))
    assert torch.equal(linear(x, w), linear(x, dense))
    assert all(torch.equal(a, b) for a, b in zip(linears(x, [w, dense]), [linear(x, dense)] * 2, strict=True))
    assert torch.equal(swiglu(x, w, dense), F.silu(linear(x, dense)) * linear(x, dense))


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("T", [1, 3, 4])
def test_a_few_tokens_on_the_cpu_read_the_stored_blocks(model_file, monkeypatch, quant, T):
    """A decode step on the CPU device: the compiled matvec reads the head and the projections from their
    blocks (nothing dequantized, the head least of all), each row with the bits it has alone."""
    w = output_head(model_file, quant)
    dense = w.dequantize(torch.float32)
    x = torch.randn(T, dense.shape[1], generator=torch.Generator().manual_seed(2))
    expected = F.linear(x.double(), dense.double())

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was dequantized")

    monkeypatch.setattr(Stored, "dequantize", refuse)
    monkeypatch.setattr(ops_linear, "dequantize", refuse)
    scale = float(expected.abs().max())
    for got in (linear(x, w), head_logits(x, w), *linears(x, [w, w])):
        assert got.dtype == x.dtype and float((got.double() - expected).abs().max()) < 1e-4 * scale
    assert torch.equal(linear(x, w)[-1:], linear(x[-1:], w))
