"""The scheduler on a GPU: decode steps that guess streamed experts ahead report their picks for /metrics."""

from __future__ import annotations

import pytest
from test_scheduler import collect, drain

import moestream
from moestream.serving.scheduler import Scheduler

pytestmark = pytest.mark.gpu


def test_decode_reports_guessed_and_held_picks(model_file):
    engine = moestream.load(
        model_file("tiny", "Q4_K_M"), device="cuda", progress=False, n_cpu_moe="all", expert_cache=3
    )
    s = Scheduler(engine, max_seqs=1)  # one sequence: one-token steps, which guess a layer ahead
    try:
        req, events = collect([5, 6, 7, 8, 9, 10], max_tokens=24)
        s.submit(req)
        assert drain(events)[-1].kind == "done"
        counted = engine.experts.counters.stats()
        assert s.stats.picks == counted.picks > 0
        assert s.stats.guessed == counted.picks - counted.misses and 0 < s.stats.guessed <= s.stats.picks
        assert 0 < s.stats.held == counted.cached < s.stats.picks
    finally:
        s.stop()
        engine.close()
