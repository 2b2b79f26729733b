"""scripts/serve_bench.py, the engine-neutral load client, against the real server on loopback."""

from __future__ import annotations

import pytest
import serve_bench
from local_server import LocalServer

import moestream


@pytest.fixture(scope="module")
def server(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=512, ubatch=16)
    srv = LocalServer(engine, max_seqs=2)
    yield srv.url.removesuffix("/v1")
    srv.stop()
    engine.close()


def test_a_phase_counts_every_generated_token_and_no_failure(server):
    r = serve_bench.phase(server, n_clients=2, seconds=1.0, max_tokens=6, key=None)
    assert r["requests"] >= 2 and r["failed"] == 0
    assert r["tokens_s"] == pytest.approx(6 * r["requests"] / r["seconds"])  # ignore_eos: each request makes 6
    assert 0 < r["ttft_p50"] <= r["ttft_p95"] and r["stream_tokens_s"] > 0


def test_a_refused_request_is_counted_and_said_once(server, capsys):
    r = serve_bench.phase(server, n_clients=2, seconds=0.5, max_tokens=100000, key=None)
    assert r["requests"] == 0 and r["failed"] >= 2
    assert capsys.readouterr().out.count("request failed: HTTP 400") == 1


def test_the_rows_name_the_engine_and_each_client_count(server, monkeypatch, capsys):
    args = ["x", "--url", server, "--clients", "1,2", "--seconds", "0.5", "--max-tokens", "4", "--label", "tiny"]
    monkeypatch.setattr("sys.argv", args)
    serve_bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]
    assert all(row.split("|")[4].strip() == "0" for row in rows)  # failed


def test_bad_flags_and_a_dead_server_exit_with_a_reason(monkeypatch):
    monkeypatch.setattr("sys.argv", ["x", "--url", "http://127.0.0.1:9", "--clients", "a,b"])
    with pytest.raises(SystemExit, match="comma-separated counts"):
        serve_bench.main()
    monkeypatch.setattr("sys.argv", ["x", "--url", "http://127.0.0.1:9", "--seconds", "1"])
    with pytest.raises(SystemExit, match="warm-up request failed"):
        serve_bench.main()
