"""qwen3moe against transformers' Qwen3MoeForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
from reference import greedy, prompt_tokens, qwen3moe_reference, rel_err

import moestream
from moestream.runtime.sampling import SamplingParams


@pytest.mark.parametrize(
    "preset,quant",
    [("tiny", "F32"), ("tiny-odd", "F32"), ("tiny", "Q8_0"), ("tiny", "Q4_K_M"), ("tiny-odd", "Q4_K_M")],
)
def test_logits_and_greedy_match_transformers(model_file, preset, quant):
    path = model_file(preset, quant)
    ref = qwen3moe_reference(path)
    engine = moestream.load(path, device="cpu", ubatch=7, progress=False)
    tokens = prompt_tokens(23, engine.spec.n_vocab)
    ours = engine.logits(tokens)
    with torch.inference_mode():
        theirs = ref(torch.tensor([tokens])).logits[0]
    err = rel_err(ours, theirs)
    assert err < 1e-4, f"{preset} {quant}: logits differ from transformers by {err:.2e} (relative)"

    params = SamplingParams(max_tokens=32, temperature=0.0, stop_at_eos=False)
    assert engine.generate(tokens, params).tokens == greedy(ref, tokens, 32)
    engine.close()


def test_ubatch_size_does_not_change_logits(model_file):
    path = model_file("tiny", "F32")
    tokens = prompt_tokens(40, 1280, seed=3)
    a = moestream.load(path, device="cpu", ubatch=40, progress=False).logits(tokens)
    b = moestream.load(path, device="cpu", ubatch=9, progress=False).logits(tokens)
    assert rel_err(a, b) < 1e-5
