"""Dense weights kept as stored: slices of a quantized head equal the whole head dequantized at once."""

from __future__ import annotations

import pytest
import torch

from moestream.formats.gguf import GGUFFile
from moestream.offload.dense import DenseWeights


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 7, 100, 10**6])
def test_row_chunks_equal_whole_weight(model_file, quant, rows):
    f = GGUFFile(model_file("tiny", quant))
    dense = DenseWeights({"output.weight": f.tensors["output.weight"]}, torch.device("cpu"), torch.float32)
    whole = dense["output.weight"]
    chunks = list(dense.row_chunks("output.weight", rows))
    assert len(chunks) == -(-whole.shape[0] // rows)
    assert torch.equal(torch.cat(chunks), whole)
