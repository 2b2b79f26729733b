"""scripts/hostile_load.py scaled down to a few seconds: streaming clients, half-open connections and a template
that renders 60 MB, all at once, against a real `moestream serve` on the CPU device.

The bounds hold on a loaded 2-core machine that also runs the clients (the probes' own loop adds to their
latency there): /health's median under 200 ms and its slowest probe under 2 s (a p99 bound of 500 ms over ~50
probes failed once in a fresh-clone CI run at 700 ms, one stall; 200 ms p99 is the full run of
docs/benchmarks.md); the server before the hardening missed both by far: every probe and request waited out its
20 s deadline."""

from __future__ import annotations

from hostile_load import run_load


def test_the_server_survives_hostile_load():
    out = run_load(seconds=4, clients=8, half_open=100, hostile=2, template_mb=60, deadline=20)
    summary = {k: v for k, v in out.items() if k != "server log tail"}
    assert out["health probes"] > 20 and out["health p50 ms"] < 200 and out["health max ms"] < 2000, summary
    assert out["streams"] > 0 and out["hostile requests"] > 0, summary
    assert out["failed"] == 0, summary
    assert out["server peak RSS MiB"] < 1024, summary
    assert out["server exit"] == 130 and out["server tracebacks"] == 0, out["server log tail"]
