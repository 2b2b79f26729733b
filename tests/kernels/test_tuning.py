"""The kernels' tuning: one frozen object, changed for a block of code and put back after it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moestream.kernels import launch, matvec, tuning


def test_use_changes_the_tuning_for_its_block_only():
    before = tuning.current()
    with tuning.use(warps=2, max_tokens=1) as inside:
        assert tuning.current() is inside and (inside.warps, inside.max_tokens) == (2, 1)
        assert inside.rows_per_program == before.rows_per_program
    assert tuning.current() is before
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.warps = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="no_such_knob"):
        with tuning.use(no_such_knob=1):
            pass
    assert tuning.current() is before


def test_launch_choices_read_the_tuning_of_their_call():
    w, x = torch.randn(3, 16), torch.randn(2, 16)
    assert torch.equal(matvec.linear_each_row(x, w), torch.cat([torch.nn.functional.linear(r, w) for r in x.split(1)]))
    with tuning.use(max_tokens=1):  # two rows are now a batch: one product
        assert torch.equal(matvec.linear_each_row(x, w), torch.nn.functional.linear(x, w))
    with tuning.use(pdl=True):
        assert launch.pdl(x) == dict(PDL=False, launch_pdl=False)  # never for CPU tensors
