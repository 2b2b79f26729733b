"""--cache-policy: what each policy ranks first after a run of passes, worked by hand, and that a decode with each
gives the uncached tokens while its cache follows the picks."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.offload.cache_policy import DECAY, CachePolicy

GATHERED = dict(device="cpu", n_cpu_moe="all", small_batch="gather", prefetch=2, progress=False)


def passes(policy: CachePolicy, picks: list[list[int]]) -> None:
    """One pass per entry: the experts of layer 0 picked in it (what the misses kernel adds to the counts)."""
    for experts in picks:
        policy.counts[0, experts] += 1
        policy.end_pass()


def top(policy: CachePolicy, n: int, held: list[int] = ()) -> list[int]:
    mask = torch.zeros(policy.counts.shape, dtype=torch.bool)
    mask[0, list(held)] = True
    return sorted(policy.ranking(mask)[0].topk(n).indices.tolist())


# expert 0 was popular long ago, 4 for a long while after, 1 lately, 2 and then 3 once each at the end
HISTORY = [[0]] * 10 + [[4]] * 20 + [[1]] * 8 + [[2]] + [[3]]


@pytest.mark.parametrize("name,want", [("static", [0, 4]), ("lru", [2, 3]), ("lfu", [1, 4])])
def test_each_policy_ranks_by_its_own_rule(name, want):
    policy = CachePolicy(name, torch.zeros(2, 6, dtype=torch.long))
    passes(policy, HISTORY)
    assert top(policy, 2) == want
    if name == "lfu":  # each pick weighs DECAY to the power of the passes since
        ref = torch.zeros(6, dtype=torch.float64)
        for age, experts in enumerate(reversed(HISTORY)):
            ref[experts] += DECAY**age
        assert torch.allclose(policy.score[0].double(), ref, rtol=1e-5)


def test_a_held_expert_wins_a_tie():
    policy = CachePolicy("static", torch.zeros(1, 4, dtype=torch.long))
    passes(policy, [[0, 1, 2]])
    assert top(policy, 1, held=[1]) == [1] and top(policy, 1, held=[2]) == [2]


def test_an_unknown_policy_is_one_clear_line():
    with pytest.raises(MoestreamError, match="--cache-policy mru: choose static, lru, lfu"):
        CachePolicy("mru", torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(MoestreamError, match="--cache-policy mru"):
        moestream.load("unused.gguf", cache_policy="mru")


@pytest.mark.parametrize("name", ["lru", "lfu"])
def test_a_recent_policy_decodes_the_same_tokens(model_file, name):
    """The cache holds the file's bytes whichever experts it holds: the same greedy tokens as no cache."""
    path = model_file("tiny", "Q4_K_M")
    runs = {}
    for policy, n in (("static", 0), (name, 3)):
        e = moestream.load(path, expert_cache=n, cache_policy=policy, **GATHERED)
        try:
            out = e.generate(list(range(5, 13)), moestream.SamplingParams(max_tokens=10, temperature=0.0))
            runs[policy] = out.tokens
            if n:
                cache = e.experts.prefetcher.cache
                assert cache.policy.name == name and cache.moved > 0 and e.experts.counters.stats()[4] > 0
        finally:
            e.close()
    assert runs[name] == runs["static"]


def test_a_recent_policy_refreshes_every_few_passes(model_file, monkeypatch):
    e = moestream.load(model_file("tiny", "Q4_K_M"), expert_cache=2, cache_policy="lru", **GATHERED)
    try:
        cache = e.experts.prefetcher.cache
        seen = []
        monkeypatch.setattr(cache, "refresh", lambda: seen.append(cache.passes))
        for _ in range(20):
            cache.end_pass()
        assert seen == [1, 2, 4, 8, 12, 16, 20]
    finally:
        e.close()
