"""What a connection may hold: half-open requests and idle keep-alive connections are closed after --timeout,
and connections past --max-connections are closed at once; a real server on 127.0.0.1, the openai client after."""

from __future__ import annotations

import logging
import socket
import time

import openai
import pytest
from local_server import LocalServer

import moestream

TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=1024, ubatch=16)
    srv = LocalServer(engine, timeout=TIMEOUT, max_connections=8)
    yield srv
    srv.stop()
    engine.close()


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed s (it may answer first), or None if it is still open."""
    s.settimeout(seconds)
    start = time.monotonic()
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - start


def works(srv) -> bool:
    c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=30)
    return c.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # nothing at all
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",  # headers cut short
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"prompt": ',  # a body cut short
    ],
)
def test_a_half_open_connection_is_closed_after_the_timeout(server, sent, caplog):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(sent)
        took = closed_within(s, 10 * TIMEOUT + 5)
    assert took is not None and took < 10 * TIMEOUT + 5
    assert works(server)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_headers_trickled_byte_by_byte_still_meet_one_deadline(server):
    """A slow client sending a byte at a time (slowloris) does not restart the clock."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        start = time.monotonic()
        try:
            for byte in request:
                s.sendall(bytes([byte]))
                time.sleep(TIMEOUT / 5)
        except OSError:  # reset: the server closed it
            pass
        assert time.monotonic() - start < 10 * TIMEOUT + 5


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_within(s, 10 * TIMEOUT + 5) is not None


def test_connections_past_the_limit_are_closed_at_once(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            took = closed_within(extra, TIMEOUT / 2)  # before the read timeout could close it
            assert took is not None
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert works(server)
