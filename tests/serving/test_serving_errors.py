"""Hostile bodies get a JSON 400 naming the cause, a client leaving mid-body logs nothing, and an unexpected
error is a JSON 500 and one log line: real servers on 127.0.0.1, the official openai client where it can send
the body."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx2 as httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from local_server import LocalServer

import moestream
from moestream.serving.errors import Errors


@pytest.fixture(scope="module")
def server(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=1024, ubatch=16)
    srv = LocalServer(engine)
    yield srv
    srv.stop()
    engine.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)


def logged_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_json_nested_100000_deep_is_a_400(server, caplog):
    body = '{"model": "tiny", "prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(server.url + "/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests JSON too deeply" in r.json()["error"]["message"]
    assert not logged_errors(caplog)


def test_a_lone_surrogate_in_a_prompt_or_a_message_is_a_400(server, caplog):
    """JSON's \\ud83d escape, as a JavaScript client sends half of an emoji (the openai client cannot encode one)."""
    for path, body, code in [
        ("/completions", {"prompt": "half a pair: \ud83d", "max_tokens": 2}, "d83d"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x\udc00"}], "max_tokens": 2}, "dc00"),
    ]:
        r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert f"lone surrogate (\\u{code})" in r.json()["error"]["message"]
    whole = json.dumps({"prompt": "a whole pair: \U0001f600", "max_tokens": 2})  # escaped as \\ud83d\\ude00
    assert "\\ud83d\\ude00" in whole
    r = httpx.post(server.url + "/completions", content=whole, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = client(server).completions.create(model="tiny", prompt="an emoji: \U0001f600", max_tokens=2)
    assert r.choices[0].finish_reason == "length"  # the server goes on
    assert not logged_errors(caplog)


def test_a_client_leaving_mid_body_is_not_an_error(server, caplog):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "the rest never comes'
        )
        time.sleep(0.3)  # the endpoint is reading the body
    time.sleep(0.3)
    assert client(server).models.list().data[0].id == "tiny"
    assert not logged_errors(caplog)


def test_an_unexpected_error_is_a_json_500_and_one_log_line(caplog):
    """A route that fails (as a bug would), behind the middleware, on a real uvicorn: 500 with OpenAI's error
    object, one log line without a traceback, and the server goes on."""
    app = FastAPI()

    @app.get("/v1/models")
    async def broken():
        raise RuntimeError("a bug\nwith a second line")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.add_middleware(Errors)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.02)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as e:
            c.models.list()
        assert e.value.status_code == 500
        assert e.value.body["message"] == "internal error (RuntimeError: a bug); the server goes on"
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
    finally:
        srv.should_exit = True
        thread.join(10)
    lines = logged_errors(caplog)
    assert lines == ["moestream: error: GET /v1/models: RuntimeError: a bug (answered 500)"]
    assert not any(r.exc_info for r in caplog.records)
