"""glm4moe against transformers' Glm4MoeForCausalLM on the same weights, plus its file conventions."""

from __future__ import annotations

import gguf
import pytest
import torch
from reference import assert_matches_reference, glm4moe_reference, prompt_tokens, rel_err

import moestream
from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile
from moestream.models.describe import describe
from moestream.models.layouts import glm4moe
from moestream.runtime.sampling import SamplingParams
from moestream.tools.presets import get_preset
from moestream.tools.recipes import recipe
from moestream.tools.synthetic import preset_metadata

PRESETS = ("tiny-glm4moe", "tiny-glm4moe-odd")


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_and_greedy_match_transformers(model_file, preset, quant):
    """A dense first layer (two in the odd one), a shared expert, half of each head rotated, a NextN block the
    engine skips; the odd preset routes in groups and has no q/k norms."""
    path = model_file(preset, quant)
    assert_matches_reference(path, glm4moe_reference(path), f"{preset} {quant}")


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_steps_match_transformers(model_file, preset):
    """One-token steps (the static decode pass: q/k norms, or the biases added in the cache-writing launch)
    give the reference's logits at each position; greedy text alone barely sees the attention biases."""
    path = model_file(preset, "F32")
    reference = glm4moe_reference(path)
    engine = moestream.load(path, device="cpu", progress=False)
    tokens = prompt_tokens(12, engine.spec.n_vocab, seed=2)
    cache = engine.new_cache()
    engine.forward(tokens[:6], cache)
    ours = torch.cat([engine.forward([t], cache) for t in tokens[6:]])
    engine.close()
    with torch.inference_mode():
        theirs = reference(torch.tensor([tokens])).logits[0, 6:]
    err = rel_err(ours, theirs)
    print(f"{preset} decode steps: max relative logit error vs transformers {err:.2e}")
    assert err < 1e-4


def test_file_follows_llama_cpp_layout(model_file):
    """The converter's F32 tensors stay F32 in Q4_K_M (router, correction bias, attention biases); ffn_down of
    blocks 2 and 3 of the 4 (the NextN block counts, as in llama.cpp's quantizer) gets Q6_K; GLM-4.5-Air's way
    leaves out the q/k norms; the NextN block is in the file but never loaded."""
    Q = gguf.GGMLQuantizationType
    path = model_file("tiny-glm4moe", "Q4_K_M")
    with GGUFFile(path) as f:
        types = {name: t.qtype for name, t in f.tensors.items()}
    for name in ("ffn_gate_inp.weight", "exp_probs_b.bias", "attn_q.bias", "post_attention_norm.weight"):
        assert types[f"blk.1.{name}"] == Q.F32, name
    assert types["blk.2.ffn_down_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == Q.Q6_K
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down_exps.weight"] == Q.Q4_K
    assert types["blk.1.ffn_gate_shexp.weight"] == types["blk.3.nextn.eh_proj.weight"] == Q.Q4_K
    assert "blk.3.nextn.eh_proj.weight" in types and "blk.0.ffn_gate_inp.weight" not in types
    with GGUFFile(model_file("tiny-glm4moe-odd", "F32")) as f:
        assert "blk.0.attn_q_norm.weight" not in f.tensors and "blk.0.attn_q.bias" in f.tensors
    with pytest.warns(UserWarning, match="skipping 1 NextN") as caught:
        engine = moestream.load(path, device="cpu", progress=False)
    assert len([w for w in caught if "NextN" in str(w.message)]) == 1  # said once
    assert not any(name.startswith("blk.3.") for name in engine.model.weights)
    assert sorted(engine.experts.tensors) == [1, 2]  # the dense first layer has no experts
    engine.close()


def test_a_file_without_its_nextn_block_loads_the_trunk(model_file):
    """llama.cpp loads a file whose NextN tensors were left out (a trunk-only conversion) the same way."""
    with GGUFFile(model_file("tiny-glm4moe", "F32")) as f:
        for name in [n for n in f.tensors if n.startswith("blk.3.")]:
            del f.tensors[name]
        _, spec = describe(f)
    assert spec.n_layer == 3 and spec.n_layer_nextn == 1


@pytest.mark.parametrize("name", ["tiny-glm4moe", "tiny-glm4moe-odd", "glm-4.5-air", "glm-4.5"])
def test_presets_read_back_as_written(name):
    p = get_preset(name)
    assert glm4moe.read_spec(preset_metadata(p, recipe("Q4_K_M")), p.spec.n_vocab) == p.spec
    assert get_preset(name, 4).spec.expert_layers == list(range(p.spec.n_layer_dense_lead, 4))


@pytest.mark.parametrize(
    "keys,words",
    [
        ({"expert_group_count": 5}, ["12 experts in 5 groups"]),
        ({"expert_group_used_count": 4}, ["4 of them kept"]),
        ({"expert_group_count": 6, "expert_group_used_count": 1}, ["6 groups, 1 of them kept", "3 experts"]),
        ({"rope.dimension_sections": [8, 4, 4, 0]}, ["GLM-4.5V", "text models"]),
        ({"expert_gating_func": 3}, ["expert_gating_func = 3"]),
        ({"leading_dense_block_count": 4}, ["4 leading dense layers", "--layers"]),
        ({"nextn_predict_layers": 5}, ["nextn_predict_layers = 5"]),
    ],
)
def test_bad_router_or_layer_keys_are_named(keys, words):
    p = get_preset("tiny-glm4moe-odd")
    meta = preset_metadata(p, recipe("F32")) | {f"glm4moe.{k}": v for k, v in keys.items()}
    with pytest.raises(MoestreamError) as e:
        glm4moe.read_spec(meta, p.spec.n_vocab)
    for w in words:
        assert w in str(e.value)


def test_a_slice_needs_a_layer_with_experts():
    with pytest.raises(MoestreamError, match="leave none of the 1 layers"):
        get_preset("glm-4.5-air", 1)


@pytest.mark.parametrize("way", ["cpu", "upload", "gather"])
def test_streamed_small_batches_give_the_resident_tokens(model_file, way):
    """Every layer with experts streamed, one-token steps served each way (gather guesses ahead, from the
    embedding for the first layer with experts): the all-resident greedy tokens."""
    path = model_file("tiny-glm4moe-odd", "Q4_K_M")
    params = SamplingParams(max_tokens=8, stop_at_eos=False)
    prompt = prompt_tokens(9, 1291, seed=4)
    ref = moestream.load(path, device="cpu", progress=False)
    want = ref.generate(prompt, params).tokens
    ref.close()
    e = moestream.load(path, device="cpu", n_cpu_moe="all", small_batch=way, stream_min_batch=4, progress=False)
    try:
        assert e.offload.placement.streamed == [2, 3]
        assert e.generate(prompt, params).tokens == want
    finally:
        e.close()


def test_the_router_stays_float32_under_bf16(model_file):
    """A bf16 engine routes with the float32 router and bias the loader keeps (llama.cpp's F32 routing)."""
    e = moestream.load(model_file("tiny-glm4moe", "Q4_K_M"), device="cpu", dtype="bfloat16", progress=False)
    try:
        w = e.model.weights
        assert w["blk.1.ffn_gate_inp.weight"].dtype == w["blk.2.exp_probs_b.bias"].dtype == torch.float32
        assert w["blk.1.attn_norm.weight"].dtype == torch.bfloat16
        logits = e.logits(prompt_tokens(5, 1280))
        assert logits.isfinite().all()
    finally:
        e.close()
