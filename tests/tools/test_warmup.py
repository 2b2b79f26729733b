"""`moestream warmup`: compiles what a run with the same flags needs (on a GPU), says there is nothing to compile
on the CPU device, and checks its flags as run does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moestream.cli.main import main
from moestream.kernels import compiles


def test_the_cpu_device_has_nothing_to_compile(model_file, capsys):
    assert main(["warmup", "-m", model_file("tiny", "Q4_K_M"), "--device", "cpu", "-ub", "64"]) == 0
    err = capsys.readouterr().err
    assert "warmup: nothing to compile on the CPU device" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--max-seqs", "0"], "--max-seqs 0: must be at least 1"), (["-ncmoe", "auto"], "--vram-budget")],
)
def test_bad_flags_are_one_line(model_file, capsys, args, words):
    assert main(["warmup", "-m", model_file("tiny", "Q4_K_M"), "--device", "cpu", *args]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.gpu
def test_after_warmup_a_run_with_the_same_flags_compiles_nothing(model_file, tmp_path):
    path = model_file("tiny", "Q4_K_M")
    env = os.environ | {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    flags = ["-m", path, "--device", "cuda", "-ub", "64", "-ncmoe", "1"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moestream.cli", *args], capture_output=True, text=True, env=env)

    warm = cli("warmup", *flags, "--max-seqs", "2")
    assert warm.returncode == 0 and "moestream: compiled " in warm.stderr, warm.stderr
    again = cli("warmup", *flags, "--max-seqs", "2")
    assert "nothing to compile: every kernel these flags need is cached" in again.stderr, again.stderr
    run = cli("run", *flags, "-p", "hello", "-n", "8")
    assert run.returncode == 0 and compiles.FIRST not in run.stderr, run.stderr
