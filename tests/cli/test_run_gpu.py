"""`run` on a GPU takes the rows that compile fastest until a decode step of the file compiled the unrolled ones."""

from __future__ import annotations

import pytest

from moestream.cli.main import _run_rows, main
from moestream.kernels import tuning
from moestream.options import Options
from moestream.runtime import way_memory

pytestmark = pytest.mark.gpu


def test_a_first_run_takes_looped_rows_until_a_warmup_compiled_the_unrolled_ones(model_file):
    path = model_file("tiny", "Q4_K_M")
    opts = Options.make(device="cuda")
    t, k = tuning.current(), way_memory.rows_key(way_memory.file_identity(path), opts)
    assert t.unrolled != t.unrolled_cold and _run_rows(path, opts) == t.unrolled_cold
    assert main(["run", "-m", path, "-p", "hi", "-n", "4", "--device", "cuda", "--ignore-eos"]) == 0
    assert way_memory.rows_compiled(k) == [t.unrolled_cold]  # its captured step's rows
    assert _run_rows(path, opts) == t.unrolled_cold
    assert main(["warmup", "-m", path, "--device", "cuda"]) == 0
    assert way_memory.rows_compiled(k) == [t.unrolled_cold, t.unrolled]
    assert _run_rows(path, opts) == t.unrolled
