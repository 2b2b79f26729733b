"""`bench`'s markdown table: llama-bench's units (a small model is MiB and M, not 0.00 GiB), the model's whole
name, the prefetch and cache of each row, bytes uploaded in the unit that shows them."""

from __future__ import annotations

from moestream.cli import report
from moestream.cli.main import main
from moestream.options import format_size


def test_units_switch_as_llama_bench_prints_them():
    assert format_size(17.3 * 2**30) == "17.30 GiB" and format_size(12.5 * 2**20) == "12.50 MiB"
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
    # the per-token lines under the table, one a row, name the row's prefetch and cache too (alike before)
    assert main([*argv, "--small-batch", "gather", "--prefetch", "0,2", "--expert-cache", "0,2"]) == 0
    out, err = capsys.readouterr()
    per_token = [line.split(":")[0] for line in out.splitlines() if " ms a token" in line]
    assert "bench: placement 4/4, tg2 x 1 after a warm-up" in err  # progress: a line as each row starts
    assert len(per_token) == 4 and {p.split(" pf ")[1] for p in per_token} == {
        "0 ahead 0 cache 0",
        "2 ahead 1 cache 0",
        "2 ahead 1 cache 2",
    }


def test_depth_rows_carry_n_depth_in_json_and_name_it_in_the_table(model_file, capsys):
    import json

    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "8", "-n", "2", "-d", "0,24", "-r", "1", "--no-floors"]
    assert main([*argv, "-o", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_prompt"], r["n_gen"], r["n_depth"]) for r in records] == [
        ("pp8", 8, 0, 0),
        ("tg2", 0, 2, 0),
        ("pp8 @ d24", 8, 0, 24),
        ("tg2 @ d24", 0, 2, 24),
    ]
    assert main([*argv, "-o", "csv"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert '"n_depth"' in header.split(",") and len(rows) == 4
    assert main(argv) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert any("| tg2 @ d24 |" in line.replace("  ", " ") or " tg2 @ d24 |" in line for line in table)


def test_depth_and_text_together_keep_every_column(model_file, tmp_path, capsys):
    """bench -d with --text: the context and the test are the text's tokens; the rows keep llama-bench's n_depth
    and type_k/type_v beside the tokens they ran and the cache policy."""
    import json

    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 20)
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "8", "-n", "2", "-d", "0,24", "-r", "1", "--no-floors"]
    argv += ["--text", str(text), "-ctk", "q8_0", "-ctv", "f16"]
    assert main([*argv, "-o", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_depth"], r["tokens"]) for r in records] == [
        ("pp8", 0, "t.txt"),
        ("tg2", 0, "t.txt"),
        ("pp8 @ d24", 24, "t.txt"),
        ("tg2 @ d24", 24, "t.txt"),
    ]
    assert {(r["type_k"], r["type_v"], r["cache_policy"]) for r in records} == {("q8_0", "f16", "lru")}
    assert main([*argv, "-o", "csv"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert {'"n_depth"', '"type_k"', '"type_v"', '"tokens"', '"cache_policy"'} <= set(header)


def test_a_negative_depth_is_refused(model_file, capsys):
    path = model_file("tiny", "Q4_K_M")
    assert main(["bench", "-m", path, "--device", "cpu", "-d", "-1"]) == 2
    assert "-d -1: must be at least 0" in capsys.readouterr().err
