"""`bench`'s markdown table: llama-bench's units (a small model is MiB and M, not 0.00 GiB), the model's whole
name, the prefetch and cache of each row, bytes uploaded in the unit that shows them."""

from __future__ import annotations

from moestream.cli import report
from moestream.cli.main import main


def test_units_switch_as_llama_bench_prints_them():
    assert report._binary(17.3 * 2**30) == "17.30 GiB" and report._binary(12.5 * 2**20) == "12.50 MiB"
    assert report._count(30.53e9) == "30.53 B" and report._count(4.2e6) == "4.20 M"
    assert report._decimal(884736) == "884.74 kB" and report._decimal(2.5e9) == "2.50 GB"
    assert report._decimal(0) == "0 B"


def test_the_table_names_the_model_whole_and_tells_rows_apart(model_file, capsys):
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "0", "-n", "2", "-r", "1", "--no-floors", "-ncmoe", "all"]
    assert main([*argv, "--small-batch", "gather", "--prefetch", "0,2", "--expert-cache", "0,2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[1:]
    assert "prefetch" in header and "cache" in header and len(rows) == 4
    assert all("moestream-generated" in row and " MiB " in row and " M " in row for row in rows)
    cells = [[c.strip() for c in row.split("|")] for row in rows]
    column = [c.strip() for c in header.split("|")]
    pairs = {(c[column.index("prefetch")], c[column.index("cache")]) for c in cells}
    assert pairs == {("0", "0"), ("2", "0"), ("2", "2")}  # each row's own; the cache serves the prefetch: off with it
