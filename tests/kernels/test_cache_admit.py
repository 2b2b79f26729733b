"""kernels/cache_admit.py: the expert cache's admissions in one launch choose what ExpertCache's torch form (the
CPU device's) chooses, pass after pass: the same experts in the same rows, the same maps and bytes."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICE, gpu_or_interpreter

from moestream.kernels.gather import copy_rows, first_picks
from moestream.offload.expert_cache import ExpertCache


class Words:
    """A layer of n_expert experts, one 32-bit word each holding its id."""

    expert_bytes = 4

    def __init__(self, n_expert: int):
        self.n_expert = n_expert
        self.raw = torch.arange(n_expert, dtype=torch.int32).view(torch.uint8).view(n_expert, 4).to(DEVICE)

    def host_bytes(self) -> list[torch.Tensor]:
        return [self.raw]


def step(cache: ExpertCache, picks: torch.Tensor, by_kernel: bool) -> None:
    cache.counts(0).index_add_(0, picks, torch.ones_like(picks))
    first, rows, mats = first_picks(picks), [cache.tensors[0].raw[picks]], torch.arange(picks.numel(), device=DEVICE)
    if by_kernel:
        cache.admit(0, picks, first, rows, mats)
    else:
        sources, to = cache._choose(0, picks, first, mats)
        copy_rows(rows[0], sources, cache.stacks[0][0], to)
    cache.end_pass()


@gpu_or_interpreter
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(("n_expert", "n", "n_picks"), [(32, 3, 8), (32, 16, 8), (40, 12, 24), (8, 8, 8)])
def test_the_launch_admits_what_the_torch_form_does(policy, n_expert, n, n_picks):
    g = torch.Generator().manual_seed(n_expert * n + n_picks)
    caches = [ExpertCache({0: Words(n_expert)}, [0], n, torch.device(DEVICE), None, policy) for _ in range(2)]
    hot = torch.randperm(n_expert, generator=g)[: max(2, n_expert // 4)]  # a popular few, so scores tie and differ
    for _ in range(40):
        picks = torch.where(
            torch.rand(n_picks, generator=g) < 0.6,
            hot[torch.randint(len(hot), (n_picks,), generator=g)],
            torch.randint(n_expert, (n_picks,), generator=g),
        ).to(DEVICE)
        for cache, by_kernel in zip(caches, (True, False), strict=True):
            step(cache, picks, by_kernel)
        a, b = caches
        assert torch.equal(a.expert_of, b.expert_of) and torch.equal(a._map[:, :n_expert], b._map[:, :n_expert])
        filled = a.expert_of[0] >= 0  # rows never written hold whatever the allocation had
        assert torch.equal(a.stacks[0][0][filled], b.stacks[0][0][filled]) and int(a.admitted) == int(b.admitted)
    held = a.expert_of[0][a.expert_of[0] >= 0]
    assert torch.equal(a.stacks[0][0][a.slot_of[0, held]].view(torch.int32).view(-1), held.int())  # the bytes
    assert int(a.admitted) > 0
