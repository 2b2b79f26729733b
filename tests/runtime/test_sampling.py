"""Sampling at the edges of its settings: values a client may send that float32 cannot hold."""

from __future__ import annotations

import torch

from moestream.runtime.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.5, -2.0, 3.25, 0.0])


def test_a_temperature_too_small_for_float32_samples_the_top_token():
    """logits / 1e-45 overflowed to inf, and softmax made NaNs of them."""
    for temperature in (1e-45, 1e-30, 1e-8):
        assert Sampler(SamplingParams(temperature=temperature, seed=0))(LOGITS) == 1


def test_a_top_p_below_float32s_smallest_number_keeps_the_top_token():
    """1e-46 rounds to 0 against float32 probabilities, and no token was kept."""
    for top_p in (1e-46, 1e-10):
        assert Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0))(LOGITS) == 1


def test_the_same_seed_samples_the_same_tokens():
    draws = [[Sampler(SamplingParams(temperature=1.0, seed=s))(LOGITS) for _ in range(1)] for s in (3, 3)]
    assert draws[0] == draws[1]
    many = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert len({many(LOGITS) for _ in range(50)}) > 1  # a real draw, not the argmax
