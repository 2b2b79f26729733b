"""The prompt cache through the HTTP API, with the official openai client on 127.0.0.1: a chat follow-up reports
the prompt tokens it reused and answers as a cold request does."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from local_server import LocalServer

import moestream
from moestream.runtime.sampling import SamplingParams

UB = 16
SYSTEM = "You are a lighthouse keeper. " * 12  # some micro-batches of shared prefix


@pytest.fixture(scope="module")
def engine(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=2048, ubatch=UB)
    yield engine
    engine.close()


def metric(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_chat_follow_up_reuses_the_conversation_and_answers_as_cold(engine):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What do you see?"}]
    cold = SamplingParams(max_tokens=8, temperature=0.0)
    first = engine.generate(engine.tokenizer.apply_chat_template(turn1), cold).text
    turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And at night?"}]
    prompt2 = engine.encode_prompt(engine.tokenizer.apply_chat_template(turn2))
    want = engine.generate(prompt2, cold).text
    srv = LocalServer(engine, max_seqs=1)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        r1 = c.chat.completions.create(model="tiny", messages=turn1, max_tokens=8, temperature=0)
        assert r1.choices[0].message.content == first and r1.usage.prompt_tokens_details.cached_tokens == 0
        r2 = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert r2.choices[0].message.content == want
        assert cached >= UB * 4 and cached % UB == 0 and r2.usage.prompt_tokens == len(prompt2)
        chunks = list(
            c.chat.completions.create(
                model="tiny",
                messages=turn2,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
        r4 = c.chat.completions.create(
            model="tiny", messages=turn2, max_tokens=8, temperature=0, extra_body={"cache_prompt": False}
        )
        assert r4.choices[0].message.content == want and r4.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.BadRequestError, match="cache_prompt"):
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"cache_prompt": "yes"})
        assert metric(srv.url, "moestream_prompt_cache_hits_total") == 2
        assert metric(srv.url, "moestream_prompt_cache_tokens_total") >= 2 * cached
        assert metric(srv.url, "moestream_prompt_cache_host_bytes") > 0  # r4's cold run overwrote the cache
    finally:
        srv.stop()


def test_no_cache_prompt_serves_without_reuse(engine):
    srv = LocalServer(engine, max_seqs=1, cache_prompt=False)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        for _ in range(2):
            r = c.completions.create(model="tiny", prompt=SYSTEM, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(srv.url, "moestream_prompt_cache_hits_total") == 0
    finally:
        srv.stop()


def test_the_ttft_script_measures_a_warm_follow_up(engine, monkeypatch, capsys):
    """scripts/prompt_cache_ttft.py against the loopback server: the warm turn reports its cached prefix."""
    import prompt_cache_ttft

    srv = LocalServer(engine, max_seqs=2)
    try:
        url = srv.url.removesuffix("/v1")
        monkeypatch.setattr("sys.argv", ["x", "--url", url, "--tokens", "200", "--rounds", "1", "--answer-tokens", "4"])
        prompt_cache_ttft.main()
    finally:
        srv.stop()
    out = capsys.readouterr().out
    cold, warm = (int(part.split("cached ")[1].split(")")[0]) for part in out.splitlines()[0].split("ms (")[1:])
    assert cold == 0 and warm >= 160, out
    assert "warm/cold" in out
