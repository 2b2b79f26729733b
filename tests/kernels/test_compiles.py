"""Kernels compiled at first use say so once on stderr and are counted: the C matvec in a fresh cache folder
(a real compile, in a child process), Triton's through its real compilation listener; a second run with the
cache filled says nothing."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from moestream.kernels import compiles


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler: nothing compiles")
def test_a_fresh_machine_says_it_compiles_once_then_counts(model_file, tmp_path):
    path = model_file("tiny", "Q4_K_M")
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path)}  # no C matvec built yet: this "machine" is new
    args = ["run", "-m", path, "--device", "cpu", "-p", "hello", "-n", "4"]
    first = run_cli(args, env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(compiles.FIRST) == 1, first.stderr
    assert "moestream: compiled 1 kernel in " in first.stderr
    assert list((tmp_path / "moestream").glob("cpu_quant-*.so"))
    second = run_cli(args, env)
    assert second.returncode == 0, second.stderr
    assert compiles.FIRST not in second.stderr and "compiled" not in second.stderr, second.stderr


def test_triton_compiles_that_miss_the_cache_are_counted_and_chained():
    triton = pytest.importorskip("triton")
    seen = []
    saved = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        compiles.watch_triton(triton)
        compiles.watch_triton(triton)  # once: not a listener calling itself
        compiles.summary()
        listener = triton.knobs.compilation.listener
        times = triton.knobs.CompileTimes(
            ir_initialization=500_000, lowering_stages=[("ttir", 1_000_000), ("ptx", 1_500_000)], store_results=0
        )
        for hit, name in ((False, "_matvec_kernel"), (True, "_gate_up_kernel"), (False, "_gate_up_kernel")):
            listener(src=SimpleNamespace(name=name), metadata={}, metadata_group={}, times=times, cache_hit=hit)
        assert seen == [False, True, False]
        assert compiles._TALLY.count == 2 and compiles._TALLY.seconds == pytest.approx(6.0)
        compiles.compiled(7.5, "the C matvec")
        out = io.StringIO()
        assert compiles.summary(out) == 3 and compiles.summary() == 0
        want = "longest: the C matvec 7.5 s, _matvec_kernel 3.0 s, _gate_up_kernel 3.0 s"
        assert "compiled 3 kernels in 13.5 s" in out.getvalue() and want in out.getvalue(), out.getvalue()
    finally:
        triton.knobs.compilation.listener = saved


def test_cache_dirs_name_every_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dirs = compiles.cache_dirs()
    assert set(dirs) == {"triton", "torch inductor", "C matvec"}
    assert dirs["C matvec"] == str(tmp_path / "moestream")


@pytest.mark.gpu
def test_a_fresh_triton_cache_compiles_once_and_a_second_run_not(model_file, tmp_path):
    path = model_file("tiny", "Q4_K_M")
    env = os.environ | {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    args = ["run", "-m", path, "--device", "cuda", "-p", "hello", "-n", "4"]
    first = run_cli(args, env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(compiles.FIRST) == 1 and "moestream: compiled " in first.stderr, first.stderr
    second = run_cli(args, env)
    assert compiles.FIRST not in second.stderr, second.stderr


CHILD = """
import sys, threading
import triton
names = []
triton.knobs.compilation.listener = lambda **kw: kw["cache_hit"] or names.append(threading.current_thread().name)
from moestream.kernels import tuning
from moestream.runtime.loader import load
with tuning.use(compile_ahead=sys.argv[1] == "1"):
    engine = load(sys.argv[2], device="cuda", progress=False)
    cache, token, tokens = engine.new_cache(), 1, []
    for i in range(8):  # decode steps from the first token: the first one compiles every kernel they launch
        token = int(engine.forward([token], cache)[-1].argmax())
        tokens.append(token)
        if i == 0:
            print("first step compiled on:", ",".join(names))
    engine.close()
print("tokens:", tokens)
"""


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=True,
    reason="H100, 2026-12-07: 13 of the first step's kernels compiled on the pool, one before it and several after "
    "it on the main thread (the throwaway capture seems to stop part-way); compile_ahead stays off",
)
def test_a_decode_steps_kernels_compile_side_by_side_before_it_runs(model_file, tmp_path):
    """Each run in a fresh Triton cache: with compile_ahead the first decode step's kernels all compile on the
    pool's threads (several of them), without it on the main thread; the greedy tokens are the same."""
    path = model_file("tiny", "Q4_K_M")
    out = {}
    for ahead in ("1", "0"):
        env = os.environ | {"TRITON_CACHE_DIR": str(tmp_path / f"triton-{ahead}")}
        done = subprocess.run(
            [sys.executable, "-c", CHILD, ahead, path], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stderr
        first = done.stdout.split("first step compiled on:")[1].splitlines()[0].strip().split(",")
        out[ahead] = first, done.stdout.split("tokens:")[1].strip()
    pooled, alone = out["1"][0], out["0"][0]
    assert len(pooled) >= 4 and all(n.startswith("moestream-compile") for n in pooled), out
    assert len(set(pooled)) >= 2 and set(alone) == {"MainThread"}, out
    assert out["1"][1] == out["0"][1]


@pytest.mark.gpu
def test_side_by_side_compiles_on_the_pool_and_launches_nothing_until_after():
    """Launches inside the block run nothing and hand their kernels to the pool (compiled or loaded from disk
    there); after it the same launches run at once, from the process's cache, with the right results."""
    triton = pytest.importorskip("triton")
    import threading

    import torch
    import triton.language as tl

    @triton.jit
    def scaled(x, y, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * SCALE, mask=i < n)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    ys = [torch.zeros_like(x) for _ in range(3)]
    seen = []
    saved = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda **kw: seen.append(threading.current_thread().name)
    try:
        with compiles.side_by_side(triton):
            for k, y in enumerate(ys):
                scaled[(8,)](x, y, x.numel(), SCALE=k + 2, BLOCK=128)
            torch.cuda.synchronize()
            assert all(int(y.count_nonzero()) == 0 for y in ys)  # nothing ran
        assert len(seen) == 3 and all(n.startswith("moestream-compile") for n in seen), seen
        for k, y in enumerate(ys):
            scaled[(8,)](x, y, x.numel(), SCALE=k + 2, BLOCK=128)
        torch.cuda.synchronize()
        assert len(seen) == 3  # nothing compiled or loaded again
        assert all(torch.equal(y, x * (k + 2)) for k, y in enumerate(ys))
    finally:
        triton.knobs.compilation.listener = saved
