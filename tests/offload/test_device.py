"""The CPU device's memory accounting (CpuMemory): what a block allocates on top of what was there, and its peak,
as torch.cuda.max_memory_allocated reports it on a GPU."""

from __future__ import annotations

import torch

from moestream.offload.device import CpuMemory


def test_counts_new_storages_until_freed():
    with CpuMemory() as m:
        a = torch.zeros(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000
        del a
        c = torch.ones(250)  # 1000
    assert m.peak == 8000
    assert m.held == 5000
    del b, c
    assert m.held == 0


def test_views_in_place_ops_and_older_tensors_are_not_counted():
    old = torch.randn(4096)
    with torch.inference_mode(), CpuMemory() as m:
        view = old[10:100]
        old.mul_(2)
        torch.add(old, 1, out=old)
        view.t_()
        reshaped = old.view(64, 64)
        assert m.peak == 0
        product = reshaped @ reshaped  # a new [64, 64] float32
    assert m.peak == 64 * 64 * 4
    del product
    assert m.held == 0


def test_temporaries_inside_a_function_reach_the_peak():
    def f(x: torch.Tensor) -> torch.Tensor:
        big = x.repeat(16)  # 16x x, freed before returning
        return big.sum().reshape(1)

    x = torch.randn(1 << 16)
    with CpuMemory() as m:
        f(x)
    assert m.peak >= 16 * x.nbytes
    assert m.held == 0
