"""The decode policy: --small-batch parsed, the rule, a plan's gathers and guesses, and the timing helper auto
and the server's batched-or-alone choice share."""

from __future__ import annotations

import dataclasses

import pytest

from moestream.errors import MoestreamError
from moestream.offload import small_batch
from moestream.offload.small_batch import Access, Timings, rule
from moestream.options import Options, SmallBatch


def test_small_batch_modes_parse_and_auto_follows_one_rule():
    assert Options.make(device="cpu", small_batch="gather").decode.small_batch is SmallBatch.GATHER
    with pytest.raises(MoestreamError, match="^--small-batch fast: expected one of auto, upload, gather, cpu$"):
        Options.make(device="cpu", small_batch="fast")
    assert rule(Access(on_gpu=True, readable=True, kernel_ok=True, sharded=False)) is SmallBatch.GATHER
    assert rule(Access(on_gpu=True, readable=True, kernel_ok=False, sharded=False)) is SmallBatch.UPLOAD
    assert rule(Access(on_gpu=False, readable=True, kernel_ok=True, sharded=False)) is SmallBatch.UPLOAD  # CPU
    assert rule(Access(on_gpu=True, readable=False, kernel_ok=True, sharded=True)) is SmallBatch.CPU
    assert rule(Access(on_gpu=False, readable=True, kernel_ok=False, sharded=True)) is SmallBatch.GATHER
    assert str(SmallBatch.CPU) == "cpu" == SmallBatch.CPU  # as the CLI spells it, in reports


def test_a_plan_gathers_only_where_a_kernel_reads_the_experts():
    opts = Options.make(device="cpu", small_batch="gather", prefetch=3)
    readable = Access(on_gpu=True, readable=True, kernel_ok=True, sharded=False)
    plan = small_batch.decode_plan(opts, 8, readable)
    assert plan.way is SmallBatch.GATHER and plan.gathers and plan.guesses and plan.n_guess == 3
    locked_out = small_batch.decode_plan(opts, 8, dataclasses.replace(readable, readable=False))
    assert locked_out.way is SmallBatch.GATHER and not locked_out.gathers and not locked_out.guesses
    assert not small_batch.decode_plan(opts, 8, dataclasses.replace(readable, streams=False)).guesses
    assert plan.trying(SmallBatch.UPLOAD).way is SmallBatch.UPLOAD and not plan.trying(SmallBatch.UPLOAD).gathers
    auto = Options.make(device="cpu")
    assert small_batch.decode_plan(auto, 8, readable).n_guess == 8  # prefetch: the router's count
    measured = small_batch.Measured(SmallBatch.CPU, {SmallBatch.CPU: 1.0})
    assert small_batch.decode_plan(auto, 8, readable, measured).way is SmallBatch.CPU


def test_timings_skip_warm_up_and_take_the_median_of_a_window():
    t = Timings(warm_up=2, window=3)
    for s in (9.0, 9.0, 1.0, 5.0, 2.0, 3.0):  # two warm-up runs, then the last three count
        t.record("a", s)
    assert t.runs("a") == 6 and t.cost("a") == 3.0
    assert t.cost("b") == float("inf") and t.fastest(["b", "a"]) == "a"
    t.failed("a")
    assert t.cost("a") == float("inf") and t.fastest(["a", "b"]) == "a"  # the first of equals


def test_a_way_far_behind_after_its_first_timed_step_is_not_timed_further():
    import contextlib
    import time

    steps = {}

    def trial(way):
        @contextlib.contextmanager
        def opened():
            def step():
                steps[way] = steps.get(way, 0) + 1
                time.sleep({"fast": 0.002, "close": 0.003, "slow": 0.1}[way])

            yield step

        return opened()

    m = small_batch.measure(["fast", "close", "slow"], trial)
    full, cut = small_batch.WARM_UP + small_batch.STEPS, small_batch.WARM_UP + 1
    assert steps == {"fast": full, "close": full, "slow": cut} and m.chosen == "fast"
    assert m.seconds["slow"] > small_batch.OUT_OF_RACE * m.seconds["fast"]


def test_cpu_layers_are_spread_over_the_streamed_ones():
    opts = Options.make(device="cpu", small_batch="gather", cpu_layers=3)
    access = Access(on_gpu=True, readable=True, kernel_ok=True, sharded=False)
    plan = small_batch.decode_plan(opts, 8, access)
    assert plan.on_cpu(list(range(0, 24, 2))) == {4, 12, 20}  # 12 streamed layers, every fourth
    assert plan.on_cpu([5]) == {5}  # no more than there are
    assert plan.trying(SmallBatch.CPU).on_cpu([1, 4, 9]) == {1, 4, 9}  # the cpu way: all of them
    assert small_batch.decode_plan(Options.make(device="cpu"), 8, access).on_cpu([1, 4]) == frozenset()
    with pytest.raises(MoestreamError, match="^--cpu-layers -1: must be 0"):
        Options.make(device="cpu", cpu_layers=-1)
