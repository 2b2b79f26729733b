"""--small-batch auto, measured at load (Setup.settle): the way timed fastest on this device is kept, whichever
it is, and the tokens are those of the all-resident run. CPU devices with injected delays stand in for a GPU
with a slow link or slow kernels (on the CPU device the rule stands unless small_batch.ON_CPU_DEVICE)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import weakref

import pytest

import moestream
from moestream.offload import small_batch
from moestream.offload.device import CpuDevice
from moestream.options import SmallBatch
from moestream.runtime.sampling import SamplingParams

PROMPT = [(5 * t) % 900 + 3 for t in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, stop_at_eos=False)


@pytest.fixture(autouse=True)
def measured_on_the_cpu_device(monkeypatch):
    monkeypatch.setattr(small_batch, "ON_CPU_DEVICE", True)


def _greedy(engine) -> list[int]:
    return engine.generate(PROMPT, GREEDY).tokens


@pytest.mark.parametrize(
    ("delays", "not_chosen"),
    [
        (dict(copy_delay_s=0.05), {SmallBatch.UPLOAD}),  # a slow link: every picked expert's copy waits
        (dict(compute_delay_s=0.2), {SmallBatch.UPLOAD, SmallBatch.GATHER}),  # slow device kernels
    ],
    ids=["slow-link", "slow-device"],
)
def test_auto_keeps_the_way_it_timed_fastest_and_gives_resident_tokens(model_file, delays, not_chosen):
    path = model_file("tiny", "Q4_K_M")
    resident = moestream.load(path, device="cpu", progress=False)
    want = _greedy(resident)
    assert resident.setup.measured is None  # nothing streams: nothing to choose
    resident.close()
    device = CpuDevice(**delays)
    engine = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False)
    try:
        m = engine.setup.measured
        assert set(m.seconds) == {SmallBatch.GATHER, SmallBatch.UPLOAD, SmallBatch.CPU}
        assert m.chosen == min(m.seconds, key=m.seconds.__getitem__) and m.chosen not in not_chosen
        assert engine.experts.plan.way is m.chosen and engine.options.decode.small_batch is SmallBatch.AUTO
        assert engine.experts.plan.measured == dataclasses.replace(m, rebuilding=0.0)  # built from what was timed
        assert m.measuring > sum(m.seconds.values()) and m.rebuilding > 0  # what choosing cost the load
        assert f"{m.measuring:.1f} s measuring" in m.describe()
        assert _greedy(engine) == want
    finally:
        engine.close()
        device.close()


def test_a_forced_way_is_not_measured(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", n_cpu_moe="all", small_batch="upload")
    try:
        assert engine.setup.measured is None and engine.experts.plan.way is SmallBatch.UPLOAD
    finally:
        engine.close()


def test_a_way_that_needs_other_buffers_gets_its_own_placement(model_file):
    """Across two devices auto gathers by rule, with a ring of guesses; slow device kernels make the CPU's way
    faster, and the placement is rebuilt without the ring (its memory would be idle)."""
    devs = [CpuDevice(compute_delay_s=0.2) for _ in range(2)]  # 0.05 lost to a busy CPU once
    engine = moestream.load(
        model_file("tiny", "Q4_K_M"), device_impl=devs, devices="cpu,cpu", n_cpu_moe="all", progress=False
    )
    try:
        measured = engine.setup.measured
        assert set(measured.seconds) == {SmallBatch.GATHER, SmallBatch.CPU}  # no upload across devices
        assert measured.chosen is SmallBatch.CPU
        assert engine.experts.plan.way is SmallBatch.CPU and engine.experts.prefetcher is None
        engine.setup.reconfigure(slots=3)  # a new placement is measured again
        assert engine.setup.measured is not None and engine.experts.plan.way is engine.setup.measured.chosen
        assert engine.experts.counters.bytes_moved == 0  # the measuring steps' counts are gone with them
    finally:
        engine.close()
        for d in devs:
            d.close()


def test_the_cpu_device_keeps_the_rule_unless_asked(model_file, monkeypatch):
    monkeypatch.setattr(small_batch, "ON_CPU_DEVICE", False)
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", n_cpu_moe="all", progress=False)
    try:
        assert engine.setup.measured is None and engine.experts.plan.way is SmallBatch.UPLOAD
    finally:
        engine.close()


def test_the_measured_placement_is_freed_before_the_chosen_one_is_built(model_file, monkeypatch):
    """On a GPU the chosen way's placement is built inside the same --vram-budget: the one auto measured on
    must be gone by then (a reference the loader kept made it run out of memory on the H200)."""
    from moestream.runtime import loader

    built, alive_at_rebuild = [], []
    build = loader.build_offload

    def spy(*args, **kwargs):
        alive_at_rebuild.extend(ref() is not None for ref in built)
        offload = build(*args, **kwargs)
        built.append(weakref.ref(offload))
        return offload

    monkeypatch.setattr(loader, "build_offload", spy)
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", n_cpu_moe="all", progress=False)
    try:
        assert engine.setup.measured is not None and len(built) == 2
        assert alive_at_rebuild == [False]
    finally:
        engine.close()


def test_one_trial_cache_at_a_time(model_file, monkeypatch):
    """Each way auto times runs on its own KV cache, which the budget counts once: the last way's must be gone
    before the next one's is made (the step the caller still held kept it: two 16k caches overran 12 GiB)."""
    from moestream.runtime import setup

    made, alive_at_new = [], []
    new_cache = setup.new_cache

    def spy(*args, **kwargs):
        alive_at_new.append(sum(ref() is not None for ref in made))
        cache = new_cache(*args, **kwargs)
        made.append(weakref.ref(next(iter(cache.kv.k.values()))))  # a tensor the cache alone holds
        return cache

    monkeypatch.setattr(setup, "new_cache", spy)
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", n_cpu_moe="all", progress=False)
    try:
        assert engine.setup.measured is not None and len(made) >= 2
        assert alive_at_new == [0] * len(made)
    finally:
        engine.close()


def test_the_printed_choice_counts_the_rebuild(model_file, monkeypatch, capsys):
    """The line a load prints is setup.measured's, the rebuild's seconds in it (it once printed the copy
    made before the rebuild was timed: always 0.0 s)."""
    import time

    from moestream.runtime import loader

    built, build = [], loader.build_offload

    def slow_second(*args, **kwargs):
        built.append(True)
        if len(built) == 2:
            time.sleep(0.3)
        return build(*args, **kwargs)

    monkeypatch.setattr(loader, "build_offload", slow_second)
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", n_cpu_moe="all", progress=True)
    try:
        assert engine.setup.measured.rebuilding >= 0.3
        assert engine.setup.measured.describe() in capsys.readouterr().err
    finally:
        engine.close()


def test_a_later_load_takes_the_choice_an_earlier_one_timed(model_file):
    """The second load of the same file with the same options times nothing: it says where its choice came from,
    keeps the rule's placement when that is the choice (no rebuild) and gives the same tokens."""
    path = model_file("tiny", "Q4_K_M")
    device = CpuDevice(compute_delay_s=0.2)  # the CPU way wins: not the rule's upload, so the second load rebuilds
    try:
        first = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False)
        m1, want = first.setup.measured, _greedy(first)
        first.close()
        assert m1.chosen is SmallBatch.CPU and m1.measuring > 0 and m1.note == ""
        second = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False)
        m2 = second.setup.measured
        assert (m2.chosen, m2.seconds, m2.measuring) == (m1.chosen, m1.seconds, 0.0)
        assert "remembered from an earlier load" in m2.describe() and "measuring" not in m2.describe()
        assert second.experts.plan.way is SmallBatch.CPU and _greedy(second) == want
        second.close()
    finally:
        device.close()


def test_a_load_that_may_not_measure_keeps_the_rule_or_takes_a_remembered_choice(model_file):
    """measure_ways=False (a cold `run`): nothing timed, nothing remembered, the rule's way; once a load that
    measures has timed the ways, the same options take its choice (the key ignores measure_ways)."""
    path = model_file("tiny", "Q4_K_M")
    device = CpuDevice(compute_delay_s=0.2)  # the CPU way wins: not the rule's upload

    def load(**kw):
        return moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False, **kw)

    try:
        engine = load(measure_ways=False)
        assert engine.setup.measured is None and engine.experts.plan.way is SmallBatch.UPLOAD
        engine.close()
        engine = load()  # nothing was remembered: this one measures
        assert engine.setup.measured.measuring > 0 and engine.experts.plan.way is SmallBatch.CPU
        engine.close()
        engine = load(measure_ways=False)
        assert engine.setup.measured.note and engine.experts.plan.way is SmallBatch.CPU
        engine.close()
    finally:
        device.close()


def test_the_rule_s_way_remembered_keeps_the_first_placement(model_file, monkeypatch):
    from moestream.runtime import loader

    path = model_file("tiny", "Q4_K_M")
    device = CpuDevice(copy_delay_s=0.05)  # the link is slow: the rule's upload loses, gather or cpu wins
    built, build = [], loader.build_offload
    monkeypatch.setattr(loader, "build_offload", lambda *a, **kw: built.append(True) or build(*a, **kw))
    try:
        first = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False)
        chosen = first.setup.measured.chosen
        first.close()
        monkeypatch.setattr(small_batch, "rule", lambda access: chosen)  # as if the rule named what was timed
        built.clear()
        second = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False)
        assert len(built) == 1 and second.experts.plan.way is chosen  # no second placement
        assert second.experts.plan.measured.note and second.setup.measured.rebuilding < 0.05
        second.close()
    finally:
        device.close()


@pytest.mark.parametrize("change", [dict(slots=2), dict(n_ctx=1024)])
def test_other_options_a_rewritten_file_or_a_damaged_memory_measure_again(model_file, tmp_path, change):
    from moestream.runtime import way_memory

    path = tmp_path / "m.gguf"
    shutil.copy(model_file("tiny", "Q4_K_M"), path)
    device = CpuDevice(compute_delay_s=0.2)

    def measuring(**kw) -> float:
        engine = moestream.load(path, device="cpu", n_cpu_moe="all", device_impl=device, progress=False, **kw)
        engine.close()
        return engine.setup.measured.measuring if engine.setup.measured else -1.0

    try:
        assert measuring() > 0 and measuring() == 0.0
        assert measuring(**change) > 0  # other options: their own choice
        st = os.stat(path)  # the file rewritten with the same bytes: another modification time
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert measuring() > 0
        way_memory.memory_file().write_text("{not json")
        assert measuring() > 0 and measuring() == 0.0  # measured, and the memory written whole again
    finally:
        device.close()


def test_the_memory_keeps_the_newest_choices(monkeypatch):
    from moestream.offload.small_batch import Measured
    from moestream.runtime import way_memory

    monkeypatch.setattr(way_memory, "KEEP", 3)
    for i in range(5):
        way_memory.remember(f"k{i}", Measured(SmallBatch.GATHER, {SmallBatch.GATHER: i / 1000}))
    way_memory.remember("k2", Measured(SmallBatch.CPU, {SmallBatch.CPU: 1.0}))  # chosen again: newest
    assert [way_memory.recall(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert way_memory.recall("k2").chosen is SmallBatch.CPU and way_memory.recall("k1") is None


def test_a_closed_setup_keeps_the_row_unrollings_its_captured_steps_compiled(model_file, tmp_path):
    """What `run` reads to take unrolled rows only once compiled (tests/cli/test_run_gpu.py captures real steps)."""
    from moestream.runtime import way_memory

    path, other = model_file("tiny", "Q4_K_M"), tmp_path / "other.gguf"
    shutil.copy(path, other)
    e = moestream.load(path, device="cpu", progress=False)
    k = way_memory.rows_key(way_memory.file_identity(path), e.options)
    assert way_memory.rows_compiled(k) == [] and e.setup.capturing.unrolled == set()  # the CPU captures nothing
    e.setup.capturing.unrolled.add(8)  # as a captured CUDA step records its tuning
    e.close()
    assert way_memory.rows_compiled(k) == [8]
    way_memory.remember_rows(k, 0)
    way_memory.remember_rows(k, 8)
    assert way_memory.rows_compiled(k) == [8, 0]
    assert way_memory.rows_compiled(way_memory.rows_key(way_memory.file_identity(other), e.options)) == []
    entries = json.loads(way_memory.memory_file().read_text())
    entries[k] = {"unrolled": "x"}  # damaged: as if never compiled
    way_memory.memory_file().write_text(json.dumps(entries))
    assert way_memory.rows_compiled(k) == []
