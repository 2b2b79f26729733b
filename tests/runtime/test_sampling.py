"""Sampling at the edges of its settings: values a client may send that float32 cannot hold."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moestream.errors import MoestreamError
from moestream.runtime.sampling import MASKED_LOGPROB, Sampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.5, -2.0, 3.25, 0.0])


def test_a_temperature_too_small_for_float32_samples_the_top_token():
    """logits / 1e-45 overflowed to inf, and softmax made NaNs of them; 1e-300 (a client's value) is 0 in
    float32, and logits / 0 were NaNs."""
    for temperature in (1e-300, 1e-46, 2**-127, 1e-45, 1e-30, 1e-8):
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


def test_penalties_as_llama_cpp():
    """A positive logit is divided by the repeat penalty, a negative one multiplied; presence subtracts once,
    frequency per occurrence; only the last repeat_last_n tokens (the prompt's included) count."""
    params = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=3)
    sampler = Sampler(params, prompt=[0, 3, 3, 2])  # token 0 has left the window of 3
    out = sampler._penalised(LOGITS)
    expected = LOGITS.clone()
    expected[3] = 3.25 / 2 - 0.5 - 2 * 0.25
    expected[2] = -2.0 * 2 - 0.5 - 0.25
    assert torch.equal(out, expected)
    assert sampler(LOGITS) == 1  # greedy: 3.5 untouched is now the top
    assert list(sampler.recent) == [3, 2, 1]


def test_greedy_avoids_a_penalised_repeat():
    sampler = Sampler(SamplingParams(repeat_penalty=1.5), prompt=[1])
    assert sampler(LOGITS) == 3  # 3.5 / 1.5 < 3.25
    assert Sampler(SamplingParams(repeat_penalty=1.5, repeat_last_n=0), prompt=[1])(LOGITS) == 1  # 0: off


def test_min_p_keeps_tokens_near_the_top_one_before_temperature():
    """p_i >= min_p * p_max on the logits as they are (llama.cpp applies temperature after the filters)."""
    ratio = math.exp(3.25 - 3.5)  # token 3's probability over token 1's
    keep_two = SamplingParams(temperature=100.0, min_p=ratio * 0.99, seed=0)
    sampler = Sampler(keep_two)
    picks = {sampler(LOGITS) for _ in range(40)}
    assert picks == {1, 3}
    only_top = SamplingParams(temperature=100.0, min_p=ratio * 1.01, seed=0)
    sampler = Sampler(only_top)
    assert {sampler(LOGITS) for _ in range(10)} == {1}


@pytest.mark.parametrize(
    ("changes", "word"),
    [
        ({"max_tokens": -2}, "-n -2"),
        ({"min_p": 1.5}, "--min-p"),
        ({"repeat_penalty": 0.0}, "--repeat-penalty"),
        ({"repeat_last_n": -1}, "--repeat-last-n"),
        ({"presence_penalty": math.nan}, "--presence-penalty"),
    ],
)
def test_bad_values_are_named(changes, word):
    with pytest.raises(MoestreamError, match=word):
        SamplingParams(**changes)


def test_minus_one_means_until_done_and_a_random_seed():
    p = SamplingParams(max_tokens=-1, seed=-1)
    assert p.limit == math.inf and p.seed is None


def test_logit_bias_adds_to_the_logit_and_minus_100_bans():
    assert Sampler(SamplingParams(logit_bias={1: -0.5}))(LOGITS) == 3  # 3.0 < 3.25
    assert Sampler(SamplingParams(logit_bias={4: 10.0}))(LOGITS) == 4
    banned = Sampler(SamplingParams(temperature=100.0, logit_bias={1: -100, 3: -math.inf}, seed=0))
    assert {banned(LOGITS) for _ in range(60)} == {0, 2, 4}
    with pytest.raises(MoestreamError, match="every token is banned"):
        Sampler(SamplingParams(logit_bias={i: -100 for i in range(5)}))(LOGITS)
    with pytest.raises(MoestreamError, match="names token 9"):
        Sampler(SamplingParams(logit_bias={9: 1.0}))(LOGITS)
    with pytest.raises(MoestreamError, match="--logit-bias"):
        SamplingParams(logit_bias={1: math.inf})


def test_logprobs_are_of_the_adjusted_logits_with_the_top_alternatives():
    sampler = Sampler(SamplingParams(logprobs=2, logit_bias={0: 2.0}))
    assert sampler(LOGITS) == 1
    want = torch.log_softmax(LOGITS + torch.tensor([2.0, 0, 0, 0, 0]), dim=-1)
    assert sampler.last.token == 1 and math.isclose(sampler.last.logprob, float(want[1]), rel_tol=1e-6)
    assert [t for t, _ in sampler.last.top] == [1, 3]
    assert math.isclose(sampler.last.top[1][1], float(want[3]), rel_tol=1e-6)
    assert Sampler(SamplingParams(logprobs=0))(LOGITS) == 1
    with pytest.raises(MoestreamError, match="logprobs 21"):
        SamplingParams(logprobs=21)


class _OnlyEven:
    """A constraint allowing even token ids: the pick is checked, the mask built only when it breaks it."""

    def __init__(self):
        self.masks, self.seen = 0, []

    def allows(self, token: int) -> bool:
        return token % 2 == 0

    def mask(self, n_vocab: int) -> torch.Tensor:
        self.masks += 1
        return torch.arange(n_vocab) % 2 == 0

    def advance(self, token: int) -> None:
        self.seen.append(token)


def test_a_constraint_masks_only_when_the_pick_breaks_it():
    c = _OnlyEven()
    sampler = Sampler(SamplingParams(), constraint=c)
    assert sampler(LOGITS) == 0 and c.masks == 1  # 1 broke it: the best even token
    assert sampler(torch.tensor([1.0, 0.5, -2.0, 0.25, 2.0])) == 4 and c.masks == 1  # allowed: no mask built
    assert c.seen == [0, 4]
    sampled = Sampler(SamplingParams(temperature=100.0, seed=0), constraint=_OnlyEven())
    assert {sampled(LOGITS) for _ in range(60)} == {0, 2, 4}


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repeat_penalty=1e-300),
        dict(presence_penalty=-1e308),
        dict(frequency_penalty=1e308, presence_penalty=-1e308),
    ],
)
def test_penalties_past_float32s_range_still_pick_a_token(penalties):
    """A penalty that overflows float32 gives the largest logit (or a ban where it would be inf - inf), never an
    inf or nan for the sampler to choke on."""
    logits = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for temperature in (0.0, 1.0):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1, **penalties), prompt=[0, 1])
        token = sampler(logits)
        assert 0 <= token < 4
        adjusted = sampler._penalised(logits)
        assert not adjusted.isnan().any() and not (adjusted == math.inf).any()


class _Bytes:
    """A tokenizer's three fields the JSON constraint reads: token i is the byte string words[i]."""

    def __init__(self, words: list[bytes]):
        from moestream.formats.tokenizer import NORMAL

        self.words, self.token_types, self.eos_ids = words, [NORMAL] * len(words), (len(words) - 1,)

    def token_bytes(self, i: int) -> bytes:
        return self.words[i]


def test_masked_tokens_among_the_top_logprobs_are_finite():
    """Logprobs are of the logits a response_format leaves, also where the first pick passed it unmasked; the
    masked tokens are -inf, which JSON cannot carry (a 500, or a stream strict parsers reject): vLLM's -9999."""
    from moestream.runtime.json_constraint import JsonConstraint, rules

    words = _Bytes([b"{", b"1", b"x", b" ", b"</s>"])
    sampler = Sampler(SamplingParams(logprobs=5), constraint=JsonConstraint(words, rules({"type": "number"})))
    assert sampler(LOGITS) == 1  # "{" and "x" cannot start a number, nor the end of text
    values = [v for _, v in sampler.last.top]
    assert all(math.isfinite(v) for v in values) and values.count(MASKED_LOGPROB) == 3
    assert json.loads(json.dumps(values)) == values
    assert math.isclose(sampler.last.logprob, float(torch.log_softmax(LOGITS[[1, 3]], dim=0)[0]), rel_tol=1e-6)


def test_logits_that_are_not_finite_are_refused_with_the_likely_causes():
    """NaN weights (a damaged file) or a float16 overflow: every pick was token 0, said nowhere."""
    for bad in (math.nan, math.inf):
        logits = LOGITS.clone()
        logits[2] = bad
        with pytest.raises(MoestreamError, match="NaN or infinity.*--dtype bfloat16"):
            Sampler(SamplingParams())(logits)
