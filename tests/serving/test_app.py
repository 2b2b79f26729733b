"""The server against the official openai client on 127.0.0.1, over a generated model on the CPU."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx2 as httpx
import openai
import pytest
from local_server import LocalServer

import moestream
from moestream.runtime.sampling import SamplingParams

KEY = "test-key"
QUESTIONS = ["The capital of France is", "Count: one two three", "Lighthouse keepers", "Bread needs flour and"]


@pytest.fixture(scope="module")
def model(model_file):
    return model_file("tiny", "Q4_K_M")


@pytest.fixture(scope="module")
def server(model):
    engine = moestream.load(model, device="cpu", progress=False, n_ctx=4096, ubatch=16)
    srv = LocalServer(engine, api_key=KEY)
    yield srv
    srv.stop()
    engine.close()


@pytest.fixture(scope="module")
def reference(model):
    """generate() on its own engine: what one request alone gives, greedy."""
    engine = moestream.load(model, device="cpu", progress=False, n_ctx=4096, ubatch=16)
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def run(prompt: str, chat: bool):
        gen = engine.generate(prompt, params, chat=chat)
        return gen.text, len(gen.prompt_tokens), len(gen.tokens)

    yield run
    engine.close()


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def metric(server, name: str) -> float:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_chat_whole_and_streamed_match_a_lone_generate(server, reference):
    c = client(server)
    want, n_prompt, n_gen = reference(QUESTIONS[0], chat=True)
    r = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_gen)
    assert r.usage.total_tokens == n_prompt + n_gen
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == n_gen


def test_completion_stops_at_a_stop_string(server, reference):
    want, _, _ = reference(QUESTIONS[1], chat=False)
    stop = want[4:7]
    assert stop and want.find(stop) >= 0
    r = client(server).completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].text == want[: want.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_concurrent_requests_each_get_their_lone_answer(server, reference):
    out: dict[str, str] = {}

    def ask(q: str) -> None:
        r = client(server).completions.create(model="tiny", prompt=q, max_tokens=12, temperature=0)
        out[q] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {q: reference(q, chat=False)[0] for q in QUESTIONS}


def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    assert [m.id for m in client(server).models.list().data] == ["tiny"]


def test_oversized_and_too_long_requests_are_refused(server):
    c = client(server)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="tiny", prompt="word " * 300_000, max_tokens=4)
    assert e.value.status_code == 413
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:  # a body it will not read: no keep-alive
        auth = f"Authorization: Bearer {KEY}\r\n".encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 999999999\r\n\r\n{")
        head = s.recv(65536).split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="hello", max_tokens=4095)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny", prompt="hello", max_tokens=-1)


def test_a_client_that_goes_away_frees_its_sequence(server):
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped line iterator closes the stream
        first = next(lines)  # generation is under way
        assert "error" not in first, first
        assert metric(server, "moestream_running_sequences") == 1
    deadline = time.monotonic() + 5  # the whole generation would take far longer
    while metric(server, "moestream_running_sequences") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "moestream_running_sequences") == 0


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_sequence(server):
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client stops waiting and closes the connection
        httpx.post(server.url + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    deadline = time.monotonic() + 5  # the whole answer would take far longer
    while metric(server, "moestream_running_sequences") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "moestream_running_sequences") == 0


def test_health_and_metrics(server):
    base = server.url.removesuffix("/v1")
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert metric(server, "moestream_generated_tokens_total") > 0
    assert metric(server, "moestream_queue_length") == 0
    # on the CPU device nothing is guessed or cached (the GPU gathers streamed experts): reported as 0
    assert metric(server, "moestream_expert_cache_hit_ratio") == metric(server, "moestream_prefetch_hit_ratio") == 0
    assert metric(server, "moestream_expert_cache_experts") == 0
    kv = server.scheduler.engine.setup.kv_bytes()  # the caches the requests before left pooled
    assert kv > 0 and metric(server, "moestream_kv_cache_bytes") == kv
    uptime, idle = metric(server, "moestream_uptime_seconds"), metric(server, "moestream_idle_ratio")
    assert uptime > 0 and 0 <= idle < 1  # the tests before this one kept it busy some of the time
    time.sleep(0.5)  # no pass runs: the idle share grows
    assert metric(server, "moestream_idle_ratio") > idle
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    turns = [line for line in text.splitlines() if line.startswith("moestream_turn_milliseconds{")]
    assert turns, text  # the concurrent requests before ran turns of several sequences, timed both ways
    for line in turns:
        labels, value = line.split()
        assert re.fullmatch(r'moestream_turn_milliseconds\{rows="\d+",way="(batched|alone)"\}', labels)
        assert float(value) > 0


def test_a_prompt_of_token_ids_answers_as_its_text(server):
    """Clients that tokenize themselves send ids; they got "prompt must be a string"."""
    c, tokenizer = client(server), server.scheduler.engine.tokenizer
    ids = tokenizer.encode(QUESTIONS[1])
    by_text = c.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=8, temperature=0)
    for prompt in (ids, [ids]):
        by_ids = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        c.completions.create(model="tiny", prompt=[1, tokenizer.vocab_size], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="one list of token ids"):
        c.completions.create(model="tiny", prompt=[1, "two"], max_tokens=2)


def test_an_unknown_route_or_method_answers_in_openai_error_shape(server):
    """They said FastAPI's {"detail": "Not Found"}, which OpenAI clients show as a bare status."""
    with pytest.raises(openai.NotFoundError, match="this server answers") as e:
        client(server).embeddings.create(model="tiny", input="hi")
    assert e.value.body["message"].startswith("POST /v1/embeddings: Not Found")
    r = httpx.get(server.url + "/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["message"].startswith("GET /v1/completions: Method Not Allowed")


def test_bad_fields_get_400_and_the_server_goes_on(server, reference):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="seed"):
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=1.5)
    with pytest.raises(openai.BadRequestError, match="text parts"):
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]
        )
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True, stream_options=[1])
    want, _, _ = reference(QUESTIONS[2], chat=True)
    parts = [{"type": "text", "text": QUESTIONS[2][:5]}, {"type": "text", "text": QUESTIONS[2][5:]}]
    r = c.chat.completions.create(  # null fields take their defaults; content parts are joined
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0, top_p=None
    )
    assert r.choices[0].message.content == want


def test_gpt_oss_chat_renders_harmony_and_returns_reasoning_apart(model_file):
    """A gpt-oss file: the prompt is its Harmony template's; whole and streamed answers split the generated
    text as HarmonySplit does (tests/serving/test_harmony.py), the analysis channel as reasoning_content."""
    from moestream.serving.harmony import HarmonySplit

    engine = moestream.load(model_file("tiny-gpt-oss", "Q8_0"), device="cpu", progress=False, n_ctx=1024)
    srv = LocalServer(engine, api_key=KEY)
    try:
        c = client(srv)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
        rendered = engine.tokenizer.apply_chat_template(messages)
        assert rendered.startswith("<|start|>system<|message|>") and rendered.endswith("<|start|>assistant")
        raw = c.completions.create(model="tiny", prompt=rendered, max_tokens=16, temperature=0).choices[0].text
        s = HarmonySplit()
        want = [a + b for a, b in zip(s.push(raw), s.flush(), strict=True)]
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        assert r.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special=False))
        assert [getattr(r.choices[0].message, "reasoning_content", None) or "", r.choices[0].message.content] == want
        chunks = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        streamed = ["".join(getattr(d, "reasoning_content", None) or "" for d in deltas)]
        streamed.append("".join(d.content or "" for d in deltas))
        assert streamed == want
    finally:
        srv.stop()
        engine.close()
