"""info --routing's cache table: the replay of a text's picks hits and copies exactly what the engine's own expert
cache counts for the same tokens (CPU, the gathered decode path), and a bigger LRU cache never hits less."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.options import CACHE_POLICIES
from moestream.tools.cache_replay import cache_sizes, replay
from moestream.tools.synthetic import make_model
from moestream.tools.tokens import text_tokens
from moestream.tools.trained_routing import calibration_preset

GATHERED = dict(device="cpu", n_cpu_moe="all", small_batch="gather", prefetch=2, progress=False)
N_TOKENS = 40
N_CACHED = 32  # of qwen3-30b-a3b's 128 experts a layer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "trained.gguf"
    make_model(path, calibration_preset("qwen3-30b-a3b", 3), quant="F32", progress=False)
    return str(path)


def engine_run(path: str, policy: str) -> tuple[dict[int, torch.Tensor], float, float]:
    """Each token of the text as one decode step (bench --text's decode): every layer's picks, read off the
    cache's own pick counts after each step, the hit rate the counters report and the experts the refreshes
    copied a pick."""
    e = moestream.load(path, expert_cache=N_CACHED, cache_policy=policy, **GATHERED)
    try:
        xc, steps = e.experts.prefetcher.cache, []
        cache, seen = e.new_cache(), xc.freq.clone()
        for t in text_tokens(e, limit=N_TOKENS):
            e.forward([t], cache)
            steps.append([(row > 0).nonzero().view(-1) for row in xc.freq - seen])
            seen = xc.freq.clone()
        s = e.experts.counters.stats()
        picks = {il: torch.stack([step[i] for step in steps]) for i, il in enumerate(xc.layers)}
        expert_bytes = xc.tensors[xc.layers[0]].expert_bytes
        return picks, s.cached / s.picks, xc.moved / expert_bytes / s.picks
    finally:
        e.close()


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_the_replay_hits_and_copies_what_the_engines_cache_counts(trained, policy):
    picks, counted, copied = engine_run(trained, policy)
    assert len(picks) == 3 and all(p.shape == (N_TOKENS, 8) for p in picks.values())
    assert counted > 0 and (copied > 0) == (policy == "static")  # lru and lfu admit on the device
    assert replay(picks, 128, N_CACHED, policy) == pytest.approx((counted, copied), abs=1e-12)


def test_a_bigger_lru_cache_never_hits_less(trained):
    picks, _, _ = engine_run(trained, "lru")
    rates = [replay(picks, 128, n, "lru")[0] for n in (0, 8, 16, 32, 64, 128)]
    first_sights = sum(p.unique().numel() for p in picks.values()) / sum(p.numel() for p in picks.values())
    assert rates == sorted(rates) and rates[0] == 0.0
    assert rates[-1] == pytest.approx(1 - first_sights, abs=1e-12)  # room for all: only an expert's first pick misses


def test_sizes_are_gib_of_a_real_file_else_fractions():
    rows, what = cache_sizes(17 << 30, 128)
    assert [n for _, n in rows] == [7, 15, 30, 60] and what.startswith("GiB")
    rows, what = cache_sizes(1 << 20, 128)
    assert [n for _, n in rows] == [8, 15, 30, 60] and what.startswith("fractions")
