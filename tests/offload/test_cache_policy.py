"""--cache-policy: what each policy values most after a run of passes, worked by hand; what lru and lfu admit in
the step; and that a decode with each gives the uncached tokens while its cache follows the picks."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.kernels.gather import first_picks
from moestream.offload.cache_policy import DECAY, REFRESH, CachePolicy
from moestream.offload.expert_cache import ExpertCache

GATHERED = dict(device="cpu", n_cpu_moe="all", small_batch="gather", prefetch=2, progress=False)


def passes(policy: CachePolicy, picks: list[list[int]]) -> None:
    """One pass per entry: the experts of layer 0 picked in it (what the misses kernel adds to the counts)."""
    for experts in picks:
        policy.counts[0, experts] += 1
        policy.end_pass()


def top(policy: CachePolicy, n: int) -> list[int]:
    experts = torch.arange(policy.counts.shape[1])
    return sorted(policy.worth(0, experts, picked=False).topk(n).indices.tolist())


def ranked(policy: CachePolicy, n: int, held: list[int]) -> list[int]:
    mask = torch.zeros(policy.counts.shape, dtype=torch.bool)
    mask[0, list(held)] = True
    return sorted(policy.ranking(mask)[0].topk(n).indices.tolist())


# expert 0 was popular long ago, 4 for a long while after, 1 lately, 2 and then 3 once each at the end
HISTORY = [[0]] * 10 + [[4]] * 20 + [[1]] * 8 + [[2]] + [[3]]


@pytest.mark.parametrize("name,want", [("static", [0, 4]), ("lru", [2, 3]), ("lfu", [1, 4])])
def test_each_policy_values_by_its_own_rule(name, want):
    policy = CachePolicy(name, torch.zeros(2, 6, dtype=torch.long))
    passes(policy, HISTORY)
    assert top(policy, 2) == want
    if name == "lfu":  # each pick weighs DECAY to the power of the passes since
        ref = torch.zeros(6, dtype=torch.float64)
        for age, experts in enumerate(reversed(HISTORY)):
            ref[experts] += DECAY**age
        assert torch.allclose(policy.score[0].double(), ref, rtol=1e-5)


def test_a_held_expert_wins_a_tie_at_a_refresh():
    policy = CachePolicy("static", torch.zeros(1, 4, dtype=torch.long))
    passes(policy, [[0, 1, 2]])
    assert ranked(policy, 1, held=[1]) == [1] and ranked(policy, 1, held=[2]) == [2]


class Rows:
    """A layer of 8 experts as 4 bytes each (byte values name the expert), the admission's sources."""

    n_expert, expert_bytes = 8, 4

    def __init__(self):
        self.raw = torch.arange(8, dtype=torch.uint8).repeat_interleave(4).view(8, 4)

    def host_bytes(self) -> list[torch.Tensor]:
        return [self.raw]


def step(cache: ExpertCache, picks: list[int]) -> None:
    """One pass over the one layer: its picks counted, admitted from their own rows, the pass ended."""
    ids = torch.tensor(picks)
    cache.counts(0).index_add_(0, ids, torch.ones_like(ids))
    cache.admit(0, ids, first_picks(ids), [cache.tensors[0].raw[ids]], torch.arange(len(picks)))
    cache.end_pass()


def held(cache: ExpertCache) -> list[int]:
    """The experts held, checked against the map and the rows' bytes."""
    experts = [e for e in cache.expert_of[0].tolist() if e >= 0]
    for r, e in enumerate(cache.expert_of[0].tolist()):
        if e >= 0:
            assert cache.slot_of[0, e] == r and cache.stacks[0][0][r].tolist() == [e] * 4
    assert sorted((cache.slot_of[0] >= 0).nonzero().view(-1).tolist()) == sorted(experts)
    return sorted(experts)


def test_lru_admits_each_pick_over_the_least_recently_picked():
    cache = ExpertCache({0: Rows()}, [0], 3, torch.device("cpu"), None, "lru")
    step(cache, [0, 1])
    assert held(cache) == [0, 1]
    step(cache, [2, 2])  # a repeated pick is admitted once
    assert held(cache) == [0, 1, 2]
    step(cache, [1, 3])  # 0 was picked longest ago; 1, picked now, stays
    assert held(cache) == [1, 2, 3]
    step(cache, [4, 5, 6, 7])  # more picks than rows: three admitted, over the three held
    assert len(held(cache)) == 3 and set(held(cache)) < {4, 5, 6, 7}
    assert int(cache.admitted) == 4 * (2 + 1 + 1 + 3) and cache.moved == 0


def test_lfu_admits_a_pick_only_over_a_weaker_one():
    cache = ExpertCache({0: Rows()}, [0], 2, torch.device("cpu"), None, "lfu")
    for _ in range(5):
        step(cache, [0, 1])
    step(cache, [2])  # once against five times (decayed): not admitted
    assert held(cache) == [0, 1]
    for _ in range(40):  # 0 and 1 fade, 2 and 3 are picked every pass
        step(cache, [2, 3])
    assert held(cache) == [2, 3]


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
                assert cache.policy.name == name and int(cache.admitted) > 0 and e.experts.counters.stats()[4] > 0
        finally:
            e.close()
    assert runs[name] == runs["static"]


def test_only_static_refreshes(model_file, monkeypatch):
    for policy, want in (("static", [1, 2, 4, 8, 16, 32, 64, 96]), ("lru", []), ("lfu", [])):
        e = moestream.load(model_file("tiny", "Q4_K_M"), expert_cache=2, cache_policy=policy, **GATHERED)
        try:
            cache = e.experts.prefetcher.cache
            seen = []
            monkeypatch.setattr(cache, "refresh", lambda c=cache, s=seen: s.append(c.passes))
            for _ in range(3 * REFRESH):
                cache.end_pass()
            assert seen == want
        finally:
            e.close()
