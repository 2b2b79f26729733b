"""Ctrl-C and SIGTERM on a real `moestream serve` with streams in flight: 503 while draining, a stream that ends
within --shutdown-timeout ends as usual, one that does not gets an error event and [DONE], a second Ctrl-C ends
at once, and the process exits 130 / 143 with one line and no traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai
import pytest


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as tests/cli/test_signals.py: a background suite ignores it


class Serve:
    def __init__(self, model: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv = [sys.executable, "-m", "moestream.cli", "serve", "-m", model, "--device", "cpu"]
        self.p = subprocess.Popen(
            [*argv, "--port", str(self.port), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=default_sigint,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 90
        while time.time() < deadline and self.p.poll() is None:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.p.kill()
        raise AssertionError(self.p.communicate()[1].decode())

    def finish(self) -> tuple[int, str]:
        try:
            _, err = self.p.communicate(timeout=60)
        finally:
            if self.p.poll() is None:
                self.p.kill()
        return self.p.returncode, err.decode()


def long_stream(srv: Serve, out: list[str]) -> threading.Thread:
    """A stream far longer than the test: its SSE lines land in out."""

    def read() -> None:
        body = {"prompt": "Once", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            out.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=read)
    t.start()
    deadline = time.time() + 30
    while not out and time.time() < deadline:
        time.sleep(0.05)
    assert out, "the stream did not start"
    return t


@pytest.fixture(scope="module")
def model(model_file):
    return model_file("tiny", "Q4_K_M")


def assert_one_closing_line(code: int, err: str, want_code: int, line: str) -> None:
    assert code == want_code and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == line, err


def test_sigterm_drains_ends_the_stream_with_done_and_exits_143(model):
    srv = Serve(model, "--shutdown-timeout", "1")
    lines: list[str] = []
    reader = long_stream(srv, lines)
    started = time.monotonic()
    srv.p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = httpx.get(srv.base + "/health")  # draining: refused, so a balancer sends clients elsewhere
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    reader.join(30)
    code, err = srv.finish()
    assert 1 <= time.monotonic() - started < 15
    assert lines[-2] == 'data: {"error": {"message": "the server is shutting down", "type": "server_error"}}'
    assert lines[-1] == "data: [DONE]"
    assert_one_closing_line(code, err, 143, "moestream: terminated")


def test_a_stream_that_ends_within_the_grace_ends_as_usual(model):
    srv = Serve(model, "--shutdown-timeout", "60")
    c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = c.completions.create(model="m", prompt="Once", max_tokens=40, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # under way
    srv.p.send_signal(signal.SIGINT)
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    code, err = srv.finish()
    assert_one_closing_line(code, err, 130, "moestream: interrupted")


def test_a_second_ctrl_c_ends_the_streams_at_once(model):
    srv = Serve(model, "--shutdown-timeout", "60")
    lines: list[str] = []
    reader = long_stream(srv, lines)
    srv.p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    started = time.monotonic()
    srv.p.send_signal(signal.SIGINT)
    reader.join(30)
    code, err = srv.finish()
    assert time.monotonic() - started < 10  # not the 60 s of grace
    assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
    assert_one_closing_line(code, err, 130, "moestream: interrupted")


def test_an_idle_server_stops_at_once_on_sigterm(model):
    srv = Serve(model)
    started = time.monotonic()
    srv.p.send_signal(signal.SIGTERM)
    code, err = srv.finish()
    assert time.monotonic() - started < 10
    assert_one_closing_line(code, err, 143, "moestream: terminated")
