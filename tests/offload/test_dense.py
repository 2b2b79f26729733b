"""Dense weights kept as stored: floats read into the compute dtype, quantized ones kept as their blocks and
dequantized when read."""

from __future__ import annotations

import pytest
import torch

from moestream.formats.gguf import GGUFFile
from moestream.offload.dense import DenseWeights
from moestream.ops.linear import Stored


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_stored_keeps_quantized_blocks(model_file, quant):
    f = GGUFFile(model_file("tiny", quant))
    dense = DenseWeights({"output.weight": f.tensors["output.weight"]}, torch.device("cpu"), torch.float32)
    w = dense.stored("output.weight")
    if quant == "F32":
        assert w is dense["output.weight"]
    else:
        assert isinstance(w, Stored) and torch.equal(w.dequantize(torch.float32), dense["output.weight"])
    assert dense.nbytes == f.tensors["output.weight"].nbytes
