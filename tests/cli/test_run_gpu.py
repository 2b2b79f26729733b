"""`run` on a GPU takes the rows that compile fastest, and small batches by rule, until a decode step of the file
compiled the unrolled ones (and a warmup timed the small-batch ways)."""

from __future__ import annotations

import pytest

from moestream.cli.main import _run_rows, main
from moestream.kernels import tuning
from moestream.options import Options
from moestream.runtime import way_memory

pytestmark = pytest.mark.gpu


def test_a_first_run_takes_looped_rows_until_a_warmup_compiled_the_unrolled_ones(model_file, capsys):
    path = model_file("tiny", "Q4_K_M")
    run = ["run", "-m", path, "-p", "hi", "-n", "4", "--device", "cuda", "--ignore-eos", "-ncmoe", "all"]
    opts = Options.make(device="cuda")
    t, k = tuning.current(), way_memory.rows_key(way_memory.file_identity(path), opts)
    assert t.unrolled != t.unrolled_cold and _run_rows(path, opts) == t.unrolled_cold
    assert main(run) == 0
    assert "small batches:" not in capsys.readouterr().err  # the rule's way, nothing timed
    assert way_memory.rows_compiled(k) == [t.unrolled_cold]  # its captured step's rows
    assert _run_rows(path, opts) == t.unrolled_cold
    assert main(["warmup", "-m", path, "--device", "cuda", "-ncmoe", "all"]) == 0
    assert way_memory.rows_compiled(k) == [t.unrolled_cold, t.unrolled]
    assert _run_rows(path, opts) == t.unrolled
    capsys.readouterr()
    assert main(run) == 0
    assert "remembered from an earlier load" in capsys.readouterr().err  # what the warmup timed
