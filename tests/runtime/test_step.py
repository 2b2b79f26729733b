"""Static one-token steps (the decode path CUDA graphs replay) compute what prefill computes."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.step import MIN_KEYS, key_bucket

TOKENS = torch.randint(0, 1280, (MIN_KEYS + 8,), generator=torch.Generator().manual_seed(3)).tolist()


def test_key_buckets_double_from_the_minimum_and_stop_at_the_context():
    assert [key_bucket(n, 4096) for n in (0, MIN_KEYS - 1, MIN_KEYS, 2 * MIN_KEYS, 4095)] == [
        MIN_KEYS,
        MIN_KEYS,
        2 * MIN_KEYS,
        4 * MIN_KEYS,
        4096,
    ]
    assert key_bucket(300, 400) == 400


@pytest.mark.parametrize("preset", ["tiny", "tiny-odd", "tiny-qwen35moe"])
def test_one_token_steps_match_prefill(model_file, preset):
    """Feeding a prompt a token at a time (static steps, across a key bucket) gives prefill's logits."""
    engine = moestream.load(model_file(preset, "F32"), device="cpu", progress=False, n_ctx=1024)
    try:
        ref = engine.logits(TOKENS)
        cache = engine.new_cache()
        steps = torch.cat([engine.forward([t], cache) for t in TOKENS])
    finally:
        engine.close()
    assert cache.n_past == len(TOKENS)
    assert float((steps - ref).abs().max() / ref.abs().max()) < 1e-5


def test_generate_reuses_its_cache_from_a_clean_state(model_file):
    """A second generate starts from zeroed recurrent state and gives the first one's tokens."""
    engine = moestream.load(model_file("tiny-qwen35moe", "F32"), device="cpu", progress=False)
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    try:
        first = engine.generate(TOKENS[:20], params).tokens
        other = engine.generate(TOKENS[20:30], params).tokens
        again = engine.generate(TOKENS[:20], params).tokens
    finally:
        engine.close()
    assert first == again and first != other


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_one_pass_for_several_sequences_matches_each_alone(model_file, preset):
    """forward_each: three sequences at different positions, one token each, give their lone steps' logits,
    in the order the caches were given."""
    engine = moestream.load(model_file(preset, "F32"), device="cpu", progress=False, ubatch=8)
    prompts = [TOKENS[:5], TOKENS[10:30], TOKENS[40:41]]
    try:
        alone, together = [engine.new_cache() for _ in prompts], [engine.new_cache() for _ in prompts]
        for p, a, t in zip(prompts, alone, together, strict=True):
            engine.forward(p, a)
            engine.forward(p, t)
        nxt = [7, 8, 9]
        ref = torch.cat([engine.forward([n], c) for n, c in zip(nxt, alone, strict=True)])
        got = engine.forward_each(nxt, together)
        assert [c.n_past for c in together] == [c.n_past for c in alone]
        # the caches went on the same way; rows in the other order (forward_each sorts them: one of the two
        # orders is not its own) come back in the order given
        again = engine.forward_each([5, 4, 3], together[::-1])
        ref_again = torch.cat([engine.forward([t], c) for t, c in zip([5, 4, 3], alone[::-1], strict=True)])
    finally:
        engine.close()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    assert float((again - ref_again).abs().max() / ref_again.abs().max()) < 1e-5


def test_one_token_steps_upload_whole_layers_when_min_batch_is_one(model_file):
    """--stream-min-batch 1: every one-token step streams whole layers, planned like a prefill pass."""
    path = model_file("tiny", "Q4_K_M")
    params = SamplingParams(max_tokens=8, stop_at_eos=False)
    ref = moestream.load(path, device="cpu", progress=False)
    got = moestream.load(path, device="cpu", progress=False, n_cpu_moe="all", stream_min_batch=1)
    try:
        assert ref.generate(TOKENS[:6], params).tokens == got.generate(TOKENS[:6], params).tokens
    finally:
        ref.close()
        got.close()
