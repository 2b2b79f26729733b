"""qwen3moe against transformers' Qwen3MoeForCausalLM on the same weights."""

from __future__ import annotations

import pytest
from reference import assert_matches_reference, prompt_tokens, qwen3moe_reference, rel_err

import moestream


@pytest.mark.parametrize(
    "preset,quant",
    [("tiny", "F32"), ("tiny-odd", "F32"), ("tiny", "Q8_0"), ("tiny", "Q4_K_M"), ("tiny-odd", "Q4_K_M")],
)
def test_logits_and_greedy_match_transformers(model_file, preset, quant):
    assert_matches_reference(model_file(preset, quant), qwen3moe_reference(model_file(preset, quant)), preset + quant)


def test_ubatch_size_does_not_change_logits(model_file):
    path = model_file("tiny", "F32")
    tokens = prompt_tokens(40, 1280, seed=3)
    a = moestream.load(path, device="cpu", ubatch=40, progress=False).logits(tokens)
    b = moestream.load(path, device="cpu", ubatch=9, progress=False).logits(tokens)
    assert rel_err(a, b) < 1e-5
