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


def test_named_floats_stay_float32(model_file):
    """A model's exact tensors (glm4moe's router and correction bias) keep float32 under a bf16 compute dtype."""
    f = GGUFFile(model_file("tiny-glm4moe", "Q4_K_M"))
    names = ("blk.1.ffn_gate_inp.weight", "blk.1.exp_probs_b.bias", "blk.1.post_attention_norm.weight")
    views = {n: f.tensors[n] for n in names}
    dense = DenseWeights(views, torch.device("cpu"), torch.bfloat16, float32=frozenset(names[:2]))
    assert [dense[n].dtype for n in names] == [torch.float32, torch.float32, torch.bfloat16]
    assert torch.equal(dense[names[1]], torch.from_numpy(views[names[1]].data.copy()).view(torch.float32))
    assert dense.nbytes == views[names[0]].nbytes + views[names[1]].nbytes + views[names[2]].nbytes // 2  # F32 file


def test_joined_floats_are_read_in_place_and_cost_nothing_more(model_file):
    """gpt-oss's gate, up and down expert biases as one [E, 2F + D] table: each name reads its columns of it."""
    f = GGUFFile(model_file("tiny-gpt-oss", "MXFP4_MOE"))
    names = [f"blk.0.{t}.bias" for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    dense = DenseWeights({n: f.tensors[n] for n in names}, torch.device("cpu"), torch.bfloat16)
    before, nbytes = [dense[n].clone() for n in names], dense.nbytes
    joined = dense.join(names)
    assert joined.shape == (before[0].shape[0], sum(b.shape[1] for b in before))
    for n, b in zip(names, before, strict=True):  # the same values, now views of the one table
        assert torch.equal(dense[n], b) and dense[n].untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
    assert dense.nbytes == nbytes
    rows = torch.tensor([3, 0, 3])
    assert torch.equal(joined[rows], torch.cat([b[rows] for b in before], dim=1))
