"""bench, profile, probe and run with streaming flags, end to end on a generated model (CPU)."""

from __future__ import annotations

import json
import re

import matplotlib.image

from moestream.cli.main import main
from moestream.runtime import way_memory


def test_bench_json_rows_and_invariants(model_file, capsys):
    path = model_file("tiny-odd", "Q8_0")
    argv = [
        "bench",
        "-m",
        path,
        "--device",
        "cpu",
        "-p",
        "40,64",
        "-n",
        "4",
        "-ub",
        "16",
        "-ncmoe",
        "0,3",
        "--stream",
        "serial,overlap,layer-major",
        "-r",
        "1",
        "--stream-min-batch",
        "8",
        "-o",
        "json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 3 * 3  # n_cpu_moe x stream x (pp40, pp64, tg4)
    assert all(r["same_tokens"] for r in rows)
    assert all(r["same_bits"] in (None, True) for r in rows)
    streamed = [r for r in rows if r["n_cpu_moe"] == 3 and r["test"].startswith("pp")]
    assert all(r["experts_used"] > 0 for r in streamed)
    assert all(r["compute_floor_s"] > 0 for r in rows)


def test_info_and_bench_on_a_glm4moe_file(model_file, capsys):
    """A dense first layer and a NextN block: info names them and reports routing of the layers with experts;
    bench streams the others (-ncmoe 2 streams block 1: block 0 has no experts) with the resident tokens."""
    path = model_file("tiny-glm4moe", "Q4_K_M")
    assert main(["info", path, "--routing", "--tokens", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "3 (1 dense first, 1 NextN after them, skipped)" in out and "a shared expert of FFN 256" in out
    assert re.findall(r"layer +(\d+) ", out) == ["1", "2"]
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "24", "-n", "2", "-ub", "8", "-ncmoe", "0,2,all"]
    assert main([*argv, "--stream", "layer-major", "-r", "1", "--stream-min-batch", "4", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 * 2 and all(r["same_tokens"] for r in rows)
    assert all(r["experts_used"] > 0 for r in rows if r["n_cpu_moe"] > 0 and r["test"] == "pp24")


def test_info_routing_on_a_text(model_file, tmp_path, capsys):
    """info --routing --text: a row per layer (layer 0 has no layer before it to guess from), then the means, then
    the expert cache's hit rate and link traffic per size and policy (a tiny file's sizes are fractions)."""
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 20)
    path = model_file("tiny", "F32")
    assert main(["info", path, "--routing", "--text", str(text), "--tokens", "50", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("routing on 50 tokens of t.txt"))
    rows = [line.split() for line in out[start + 2 : start + 5]]
    assert [r[:2] for r in rows[:2]] == [["layer", "0"], ["layer", "1"]] and [r[0] for r in rows[2:]] == ["mean"]
    assert out[start + 5].startswith("expert cache: hit rate / experts over the link") and "fractions" in out[start + 5]
    cache = [line.split() for line in out[start + 7 :]]
    assert [r[0] for r in cache] == ["1", "2", "4", "8"]
    cells = [r[-9:] for r in cache]  # hit / link for each of the three policies
    assert all(c[i].endswith("%") and c[i + 1] == "/" and c[i + 2].endswith("%") for c in cells for i in (0, 3, 6))
    assert rows[0][2:4] == ["-", "-"] and all(c.endswith("%") for c in rows[1][2:6])
    assert float(rows[1][-1]) <= 3.0  # entropy of 8 experts' picks, at most log2 8


def test_bench_text_runs_the_texts_tokens(model_file, tmp_path, capsys):
    """bench --text: decode is teacher-forced over the text's tokens; one word said over and over (three tokens
    in turn here) routes to the same few experts, so the static cache holds more of its picks than of random
    tokens'. lru, the default, follows the picks (a cycle of 6 experts through 3 places keeps few of them)."""
    text = tmp_path / "same.txt"
    text.write_text(" again" * 100)
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "0", "-n", "16", "-ncmoe", "all", "-r", "1", "-o", "json"]
    argv += ["--small-batch", "gather", "--prefetch", "2", "--expert-cache", "3", "--no-floors"]
    rows = {}
    for flags in ([], ["--text", str(text)]):
        assert main(argv + flags + ["--cache-policy", "static"]) == 0
        (rows[bool(flags)],) = json.loads(capsys.readouterr().out)
    assert rows[False]["tokens"] == "random" and rows[True]["tokens"] == "same.txt"
    assert rows[True]["cache_hit"] > rows[False]["cache_hit"]
    assert rows[True]["bytes_per_token"] == rows[True]["bytes_uploaded"] / 16
    assert main(argv + ["--text", str(text)]) == 0
    (lru,) = json.loads(capsys.readouterr().out)
    assert lru["cache_policy"] == "lru" and rows[True]["cache_policy"] == "static" and lru["cache_hit"] > 0


def test_profile_writes_trace_and_plot(model_file, tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    argv = [
        "profile",
        "-m",
        model_file("tiny-odd", "Q8_0"),
        "--device",
        "cpu",
        "-p",
        "48",
        "-ub",
        "16",
        "-ncmoe",
        "all",
        "--slots",
        "2",
        "--stream",
        "serial,overlap",
        "-r",
        "1",
        "--stream-min-batch",
        "8",
        "--trace",
        str(trace),
        "--plot",
        str(plot),
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "== serial" in out and "== overlap" in out and "link while copying" in out
    # progress: a line as each pass starts (profile -p 128 on the CPU ran six minutes with none)
    assert "profile: serial: warm-up pass" in err and "profile: overlap: passes 1 and 2 of 2" in err
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} >= {"moestream serial"}
    assert matplotlib.image.imread(plot).shape[0] > 100


def test_probe_prints_rates_and_floors(model_file, capsys):
    assert (
        main(["probe", "--device", "cpu", "-m", model_file("tiny", "Q4_K_M"), "-p", "64", "-ub", "32", "-ncmoe", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pinned" in out and "TFLOP/s" in out and "transfer: token-major" in out
    assert f"--small-batch auto's choices: {way_memory.memory_file()}" in out


def test_probe_reads_n_cpu_moe_past_the_layers_as_every_layer_like_run(model_file, capsys):
    """llama.cpp users write -ncmoe 99 for "all": run and bench stream every layer, so probe's floors do too."""
    path = model_file("tiny", "Q4_K_M")
    floors = {}
    for n in ("2", "99"):  # tiny has 2 layers
        assert main(["probe", "--device", "cpu", "-m", path, "-p", "64", "-ub", "32", "-ncmoe", n]) == 0
        out = capsys.readouterr().out
        floors[n] = re.search(r"\(\d+ x [\d.]+ [KMG]iB\)", out).group()  # the bytes streamed, not the rates
    assert "every layer streams, as in llama.cpp" in out
    assert floors["99"] == floors["2"]


def test_run_streams_text_with_experts_in_host_ram(model_file, capsys):
    argv = [
        "run",
        "-m",
        model_file("tiny", "Q4_K_M"),
        "-p",
        "Hello there",
        "-n",
        "8",
        "--device",
        "cpu",
        "-ncmoe",
        "all",
        "--stream",
        "layer-major",
        "-ub",
        "4",
        "--stream-min-batch",
        "2",
        "--seed",
        "3",
        "--temp",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "generated" in captured.err and "tok/s" in captured.err


def test_bench_reports_guesses_and_the_expert_cache(model_file, capsys):
    """tg rows with --prefetch and --expert-cache lists: how many picks were guessed and held, same tokens."""
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "0", "-n", "12", "-ncmoe", "all", "-r", "1"]
    argv += ["--small-batch", "gather", "--prefetch", "2", "--expert-cache", "0,3", "--no-floors"]
    assert main(argv + ["-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["prefetch"], r["expert_cache"]) for r in rows] == [(2, 0), (2, 3)]
    assert rows[0]["cache_hit"] is None and 0 < rows[1]["cache_hit"] < 1
    assert rows[1]["bytes_uploaded"] < rows[0]["bytes_uploaded"]  # held experts cross no link
    assert all(r["same_tokens"] is not False and 0 < r["prefetch_hit"] <= 1 for r in rows)
    assert main(argv) == 0
    assert "expert cache 3 a layer:" in capsys.readouterr().out


def test_bench_sweeps_how_far_ahead_the_guess_is_made(model_file, capsys):
    """--prefetch-ahead 1,2: a row each, the depth in -o json and in the table, each row's picks guessed."""
    path = model_file("tiny", "Q4_K_M", layers=4)
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "0", "-n", "8", "-ncmoe", "all", "-r", "1", "--no-floors"]
    argv += ["--small-batch", "gather", "--prefetch", "2", "--prefetch-ahead", "1,2"]
    assert main(argv + ["-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["prefetch"], r["prefetch_ahead"]) for r in rows] == [(2, 1), (2, 2)]
    assert all(r["same_tokens"] is not False and 0 < r["prefetch_hit"] <= 1 for r in rows)
    assert main(argv) == 0
    out = capsys.readouterr().out
    cells = [{c.strip() for c in line.split("|")} for line in out.splitlines() if line.startswith("| ")]
    assert "2" in cells[1] and "2 @2" in cells[2]  # the table's prefetch column: the depth when not 1
    assert "prefetch 2 a layer 1 ahead:" in out and "prefetch 2 a layer 2 ahead:" in out


def test_decode_on_the_cpu_multiplies_every_weight_from_its_blocks(model_file, capsys, monkeypatch):
    """A one-token prompt and its decode steps on the CPU device dequantize no weight (the Q6_K head and Q8_0
    projections included): the C kernel reads each one's blocks. The head was dequantized on every step."""
    from moestream.offload import expert_tensors
    from moestream.ops import linear

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was dequantized")

    monkeypatch.setattr(linear, "dequantize", refuse)
    monkeypatch.setattr(expert_tensors, "dequantize", refuse)
    for placement in ([], ["-ncmoe", "all"]):
        argv = ["run", "-m", model_file("tiny", "Q4_K_M"), "--device", "cpu", "-p", "The", "-n", "6", *placement]
        assert main(argv) == 0
        assert "generated 6 tokens" in capsys.readouterr().err
