"""qwen35moe against transformers' Qwen3_5MoeForCausalLM on the same weights, plus its file conventions."""

from __future__ import annotations

import gguf
import pytest
from reference import assert_matches_reference, prompt_tokens, qwen35moe_reference, rel_err

import moestream
from moestream.formats.gguf import GGUFFile
from moestream.models.layouts import qwen35moe
from moestream.tools.presets import get_preset
from moestream.tools.recipes import recipe
from moestream.tools.routing import routing_load
from moestream.tools.synthetic import preset_metadata

PRESET = "tiny-qwen35moe"


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_logits_and_greedy_match_transformers(model_file, quant):
    """Prefill in micro-batches of 7 (chunked delta rule, state carried), then 32 recurrent decode steps."""
    path = model_file(PRESET, quant)
    assert_matches_reference(path, qwen35moe_reference(path), f"{PRESET} {quant}")


def test_ubatch_size_does_not_change_logits(model_file):
    """100 tokens span two 64-token delta-rule chunks in one pass; ubatch 1 runs the recurrent form only."""
    path = model_file(PRESET, "F32")
    tokens = prompt_tokens(100, get_preset(PRESET).spec.n_vocab, seed=3)
    whole = moestream.load(path, device="cpu", ubatch=100, progress=False).logits(tokens)
    for ubatch in (7, 1):
        split = moestream.load(path, device="cpu", ubatch=ubatch, progress=False).logits(tokens)
        err = rel_err(split, whole)
        print(f"ubatch {ubatch} vs whole prompt: {err:.2e}")
        assert err < 1e-5, f"ubatch {ubatch}: logits differ from one micro-batch by {err:.2e}"


def test_routing_is_balanced(model_file):
    engine = moestream.load(model_file(PRESET, "Q4_K_M"), device="cpu", progress=False)
    counter = routing_load(engine, 2048)
    engine.close()
    assert bool((counter.counts > 0).all()), f"idle experts:\n{counter.counts}"
    assert float(counter.imbalance().max()) <= 3, f"busiest expert over mean load: {counter.imbalance()}"


def test_file_follows_llama_cpp_layout(model_file):
    """Every 4th layer attends; the converter's F32 tensors stay F32 in Q4_K_M; llama.cpp treats attn_qkv as an
    attn_v, which a model of 8 experts gets in Q8_0."""
    Q = gguf.GGMLQuantizationType
    path = model_file(PRESET, "Q4_K_M")
    engine = moestream.load(path, device="cpu", progress=False)
    assert engine.model.attention_layers == [3]
    engine.close()
    with GGUFFile(path) as f:
        types = {name: t.qtype for name, t in f.tensors.items()}
    for name in (
        "ssm_a",
        "ssm_dt.bias",
        "ssm_conv1d.weight",
        "ssm_norm.weight",
        "ffn_gate_inp_shexp.weight",
        "ffn_gate_inp.weight",
        "post_attention_norm.weight",
    ):
        assert types[f"blk.0.{name}"] == Q.F32, name
    assert types["blk.0.attn_qkv.weight"] == types["blk.3.attn_v.weight"] == Q.Q8_0
    assert types["blk.0.ssm_alpha.weight"] == types["blk.0.ffn_gate_shexp.weight"] == Q.Q4_K


def test_recurrent_layers_key_wins_over_interval():
    p = get_preset(PRESET)
    meta = preset_metadata(p, recipe("F32")) | {"qwen35moe.attention.recurrent_layers": [False, True, False, True]}
    assert qwen35moe.read_spec(meta, p.spec.n_vocab).extra["recurrent_layers"] == (False, True, False, True)
