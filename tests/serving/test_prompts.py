"""A chat template that renders a huge text is refused before it is tokenized (a 400 on the server, one line from
`run --chat`), and templating runs on the --threads-http pool: a generated model whose template blows up for the
message HUGE (scripts/hostile_load.py), served on 127.0.0.1 to the official openai client."""

from __future__ import annotations

import resource
import threading
import time

import httpx2 as httpx
import openai
import pytest
from hostile_load import HUGE, write_hostile_model
from local_server import LocalServer

import moestream
from moestream.cli.main import main
from moestream.formats.chat_template import MAX_CHARS_PER_TOKEN

N_CTX = 1024


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return write_hostile_model(tmp_path_factory.mktemp("hostile") / "hostile.gguf", template_mb=60)


@pytest.fixture(scope="module")
def server(hostile):
    engine = moestream.load(hostile, device="cpu", progress=False, n_ctx=N_CTX, ubatch=16)
    srv = LocalServer(engine)
    yield srv
    srv.stop()
    engine.close()


def test_a_huge_rendering_is_a_400_before_tokenizing(server):
    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(openai.BadRequestError, match=f"more than {MAX_CHARS_PER_TOKEN * N_CTX} characters"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": HUGE}], max_tokens=2)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: 60 MB never came back
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_health_answers_while_templates_render(server):
    """Four clients send the hostile message over and over: rendering and refusing run off the event loop, so
    /health answers at once meanwhile (it waited seconds for each tokenizing when they ran on the loop). Timed
    once every client has had an answer: the renderers' processes start with the first ones (a 2-core machine
    is busy starting them for half a second)."""
    stop, errors, answered = threading.Event(), [], set()  # the clients that have had an answer

    def hammer() -> None:
        while not stop.is_set():
            r = httpx.post(server.url + "/chat/completions", json={"messages": [{"role": "user", "content": HUGE}]})
            if r.status_code != 400:
                errors.append(r.text)
            answered.add(threading.get_ident())

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    took = []
    try:
        started = time.monotonic()
        while len(answered) < len(threads) and time.monotonic() < started + 30:
            time.sleep(0.01)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            start = time.perf_counter()
            assert httpx.get(server.url.removesuffix("/v1") + "/health", timeout=30).status_code == 200
            took.append(time.perf_counter() - start)
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert max(took) < 0.5, f"/health took up to {max(took):.2f} s"


def test_run_chat_refuses_a_huge_rendering_in_one_line(hostile, capsys):
    argv = ["run", "-m", hostile, "-p", HUGE, "--chat", "-n", "1", "--device", "cpu", "-c", str(N_CTX)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moestream: error: chat template: the conversation renders to more than 8192")
    assert "raise --ctx" in err[-1] and not any("Traceback" in line for line in err)


def test_threads_http_is_checked(hostile, capsys):
    assert main(["serve", "-m", hostile, "--device", "cpu", "--threads-http", "0"]) == 2
    assert "--threads-http 0: must be at least 1" in capsys.readouterr().err
