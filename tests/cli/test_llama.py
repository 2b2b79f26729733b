"""llama.cpp command lines: flags taken only as spelled, accepted with their meaning, the rest refused in one line
naming ours; `bench -o` under llama-bench's field names."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moestream
from moestream.cli.args import engine_options
from moestream.cli.llama import _Refused, refused
from moestream.cli.main import build_parser, main
from moestream.options import Options

TOKENS = list(range(5, 45))


def options(*flags: str) -> Options:
    return engine_options(build_parser().parse_args(["run", "-m", "m.gguf", "-p", "hi", *flags]))


def test_ncmoe_above_the_layer_count_streams_every_layer(model_file):
    path = model_file("tiny", "Q4_K_M")  # 2 layers
    e99 = moestream.load(path, device="cpu", progress=False, n_cpu_moe=99, ubatch=16)
    eall = moestream.load(path, device="cpu", progress=False, n_cpu_moe="all", ubatch=16)
    try:
        assert e99.offload.placement.streamed == [0, 1]
        assert "--n-cpu-moe 99 is more than the 2 layers" in e99.offload.describe()
        assert "streamed from host RAM (0.00" not in e99.offload.describe()  # a tiny model's size in KiB or MiB
        assert torch.equal(e99.logits(TOKENS), eall.logits(TOKENS))
    finally:
        e99.close()
        eall.close()


def test_threads_set_the_cpu_pool(model_file):
    saved = torch.get_num_threads()
    try:
        assert options("-t", "1").model.threads == 1
        moestream.load(model_file("tiny", "F32"), device="cpu", progress=False, threads=1).close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_batch_size_caps_the_micro_batch_and_ctx_size_sets_the_context():
    assert options("-ub", "256", "-b", "64").model.ubatch == 64
    assert options("-ub", "32", "-b", "64").model.ubatch == 32
    assert options("--ctx-size", "1024").model.n_ctx == options("-c", "1024").model.n_ctx == 1024


def test_load_mode_maps_to_host_memory(model_file, capsys):
    assert options("-lm", "mmap").placement.host_memory == "pageable"
    assert options("-lm", "none").placement.host_memory == "pinned"
    assert options().placement.host_memory == "pinned"  # the engine's default
    code = main(["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-lm", "none", "--host-memory", "pageable"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "-lm none" in err[0]


@pytest.mark.parametrize(
    ("flags", "note"),
    [
        (["-ngl", "99"], None),
        (["-ngl", "20"], "-ngl 20 is ignored"),
        (["-fa"], None),
        (["-fa", "off"], "-fa off is ignored"),
    ],
)
def test_ngl_and_fa_are_accepted_and_say_when_ignored(model_file, capsys, flags, note):
    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "2", "--device", "cpu", *flags]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (note in err) if note else ("ignored" not in err)


LLAMA_FLAGS = [
    line.split() for line in (Path(__file__).parent / "llama_flags.txt").read_text().splitlines() if line[:1] != "#"
]
REQUIRED = {"run": ["-m", "m.gguf", "-p", "hi"], "serve": ["-m", "m.gguf"], "bench": ["-m", "m.gguf"]}


def test_every_llama_flag_is_taken_or_refused_in_one_line_naming_ours(capsys):
    """Each flag of llama-cli/llama-completion (run), llama-server (serve) and llama-bench (bench)."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    refusals = 0
    for command, flag in LLAMA_FLAGS:
        action = commands[command]._option_string_actions.get(flag)
        assert action is not None, f"{command} {flag}: neither taken nor refused"
        if not isinstance(action, _Refused):
            continue
        refusals += 1
        with pytest.raises(SystemExit) as e:
            commands[command].parse_args([*REQUIRED[command], flag, "x"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, (command, flag, err)
        assert f"error: {flag} is a llama.cpp flag" in err[0] and refused(command)[flag] in err[0]
    assert 500 < refusals < len(LLAMA_FLAGS)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-co"], ["-co is a llama.cpp flag", "stdout"]),  # was -c with the value "o"
        (["-mli"], ["-mli is a llama.cpp flag", "-p"]),  # was a second -m
        (["-cnv"], ["-cnv is a llama.cpp flag", "--chat"]),
        (["--te", "0.5"], ["unrecognized arguments: --te"]),  # was "ambiguous" (--temp, --top-k, ...)
        (["--tem", "0.5"], ["unrecognized arguments: --tem"]),  # was --temp
        (["-n5"], ["unrecognized arguments: -n5"]),  # no value glued to a short flag, as llama.cpp
        (["-fx"], ["unrecognized arguments: -fx"]),  # was -fa
        (["--mirostat", "2"], ["--mirostat is a llama.cpp flag", "--min-p", "--repeat-penalty"]),
    ],
)
def test_flags_are_taken_only_as_spelled(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(["run", "-m", "m.gguf", "-p", "hi", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert all(w in err[0] for w in words), err[0]


def test_llama_cli_spellings_run(model_file, tmp_path, capsys):
    """-f FILE, -no-cnv, -s, --temperature, --predict and -cmoe as llama-cli takes them."""
    path = model_file("tiny", "Q4_K_M")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The")

    def text(*flags: str) -> str:
        assert main(["run", "-m", path, "--device", "cpu", *flags]) == 0
        return capsys.readouterr().out

    ours = text("-p", "The", "-n", "12", "--temp", "1.5", "--seed", "3", "--cpu-moe")
    assert text("-f", str(prompt), "-no-cnv", "--predict", "12", "--temperature", "1.5", "-s", "3", "-cmoe") == ours
    assert text("-p", "The", "-n", "12", "--temp", "1.5", "-s", "4") != ours


def test_n_minus_one_generates_until_the_context_is_full(model_file, capsys):
    path = model_file("tiny", "F32")
    assert main(["run", "-m", path, "--device", "cpu", "-p", "The", "-n", "-1", "-c", "24", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "stop: context" in err
    assert main(["run", "-m", path, "--device", "cpu", "-p", "The", "-n", "-2"]) == 2
    assert "-1 to generate until the end" in capsys.readouterr().err


def test_seed_minus_one_is_a_random_seed(model_file, capsys):
    path = model_file("tiny", "Q4_K_M")
    texts = set()
    for _ in range(3):
        assert main(["run", "-m", path, "--device", "cpu", "-p", "The", "-n", "16", "--temp", "2", "--seed", "-1"]) == 0
        texts.add(capsys.readouterr().out)
    assert len(texts) > 1


def test_min_p_changes_the_text(model_file, capsys):
    path = model_file("tiny", "Q4_K_M")

    def text(*flags: str) -> str:
        assert main(["run", "-m", path, "-p", "The", "-n", "24", "--device", "cpu", *flags]) == 0
        return capsys.readouterr().out

    greedy, sampled = text(), text("--temp", "1.5", "--seed", "1")
    assert text("--temp", "1.5", "--seed", "1", "--min-p", "1") == greedy  # only the top token is left
    assert text("--temp", "1.5", "--seed", "1", "--min-p", "0.01") != greedy
    assert text("--temp", "1.5", "--seed", "1", "--min-p", "0") == sampled


def test_repeat_penalty_reaches_the_sampler(model_file, capsys):
    """--repeat-penalty below 1 favours the recent tokens until one repeats; --repeat-last-n 0 turns it off."""
    path = model_file("tiny", "Q4_K_M")

    def text(*flags: str) -> str:
        assert main(["run", "-m", path, "-p", "The", "-n", "16", "--device", "cpu", "--ignore-eos", *flags]) == 0
        return capsys.readouterr().out

    greedy = text()
    repeated = text("--repeat-penalty", "0.001")
    assert repeated != greedy and text("--repeat-penalty", "0.001", "--repeat-last-n", "0") == greedy


def test_info_takes_m_and_probe_a_path(model_file, capsys):
    path = model_file("tiny", "F32")
    assert main(["info", "-m", path]) == 0
    by_m = capsys.readouterr().out
    assert main(["info", path]) == 0 and capsys.readouterr().out == by_m
    assert main(["info", path, "-m", path]) == 2 and "give the model file once" in capsys.readouterr().err
    assert main(["probe", path, "--device", "cpu", "-p", "64", "-ub", "64", "-ncmoe", "all"]) == 0
    out = capsys.readouterr().out
    assert "floors for pp64 ub64 ncmoe all" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "-m", "MODEL", "-p", "hi", "-n", "-5"],
        ["bench", "-m", "MODEL", "-r", "0"],
        ["serve", "-m", "MODEL", "--port", "0"],
        ["run", "-m", "MODEL", "-p", "hi", "--stream", "fast"],
        ["run", "-m", "nothing-here.gguf", "-p", "hi"],
        ["probe", "MODEL", "-ncmoe", "-1"],
    ],
)
def test_a_bad_value_is_answered_before_torch_loads(model_file, argv):
    """In a fresh process: one line, exit 2, no torch imported, well under half a second of CPU."""
    argv = [model_file("tiny", "F32") if a == "MODEL" else a for a in argv]
    code = "import runpy, sys; sys.argv[0] = 'moestream'; runpy.run_module('moestream.cli', run_name='__main__')"
    check = "import atexit, sys; atexit.register(lambda: 'torch' in sys.modules and print('torch loaded'))"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", f"{check}\n{code}", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "torch loaded" not in r.stdout
    assert cpu < 0.5, f"{cpu:.2f} s of CPU ({wall:.2f} s wall)"
    assert wall < 2.0  # 0.2 s on an idle dev machine; slack for a loaded one


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv"])
def test_bench_output_uses_llama_bench_names(model_file, capsys, fmt):
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "32", "-n", "3", "-ub", "16", "-b", "8", "-r", "2"]
    assert main([*argv, "-ncmoe", "99", "--no-floors", "-o", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        rows = json.loads(out)
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in out.strip().splitlines()]
    else:
        rows = list(csv.DictReader(io.StringIO(out)))
    assert [(int(r["n_prompt"]), int(r["n_gen"])) for r in rows] == [(32, 0), (0, 3)]
    for r in rows:
        assert int(r["n_ubatch"]) == 8 and int(r["n_cpu_moe"]) == 2 and r["model_filename"] == path
        assert float(r["avg_ts"]) > 0 and int(r["avg_ns"]) > 0 and r["backends"] == "CPU"
    if fmt != "csv":
        assert all(len(r["samples_ns"]) == 2 for r in rows)


@pytest.mark.parametrize("command", [[], ["run"], ["bench"], ["profile"], ["probe"], ["info"], ["make-model"]])
def test_help_of_every_command(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: moestream" in out
    if command in (["run"], ["bench"]):
        assert "(default: 512)" in out or "(default: [512])" in out  # -ub shows its default


def test_sampling_flags_change_the_text(model_file, capsys):
    """--temp/--seed/--top-k/--top-p as llama-cli: a seed repeats, another seed differs, --top-k 1 is greedy."""
    path = model_file("tiny", "Q4_K_M")

    def text(*flags: str) -> str:
        assert main(["run", "-m", path, "-p", "The", "-n", "24", "--device", "cpu", *flags]) == 0
        return capsys.readouterr().out

    greedy = text()
    sampled = text("--temp", "1.5", "--seed", "1")
    assert sampled == text("--temp", "1.5", "--seed", "1")
    assert sampled != text("--temp", "1.5", "--seed", "2")
    assert sampled != greedy
    assert text("--temp", "1.5", "--seed", "1", "--top-k", "1") == greedy
    assert text("--temp", "1.5", "--seed", "1", "--top-p", "1e-9") == greedy


def test_ctx_zero_means_the_trained_context(model_file):
    assert options("-c", "0").model.n_ctx == 0
    e = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False, n_ctx=0)
    try:
        assert e.n_ctx == e.spec.n_ctx_train
    finally:
        e.close()


def test_cache_types_as_llama_bench_takes_and_reports_them(model_file, capsys):
    """-ctk/-ctv on run (one value) and bench (comma lists, a row each, type_k/type_v as llama-bench names them)."""
    assert options("-ctk", "q8_0", "-ctv", "Q4_0").model.kv_types == ("q8_0", "q4_0")
    assert options("--cache-type-k", "f16").model.kv_types == ("f16", "bf16" if torch.cuda.is_available() else "f32")
    path = model_file("tiny", "Q4_K_M")
    argv = ["bench", "-m", path, "--device", "cpu", "-p", "16", "-n", "2", "-r", "1", "--no-floors", "-o", "json"]
    assert main([*argv, "-ctk", "f16,q4_0", "-ctv", "q8_0"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["type_k"], r["type_v"]) for r in rows] == [
        ("pp16", "f16", "q8_0"),
        ("tg2", "f16", "q8_0"),
        ("pp16", "q4_0", "q8_0"),
        ("tg2", "q4_0", "q8_0"),
    ]
    assert main([*argv, "-ctk", "q3_k"]) == 2
    assert "--cache-type-k q3_k: expected one of f32, f16, bf16, q8_0, q4_0" in capsys.readouterr().err


def test_logit_bias_as_llama_cpp(model_file, capsys):
    """-l TOKEN(+|-)BIAS: a ban changes the greedy text, biases for one token add up, a bad spelling is one line."""
    path = model_file("tiny", "Q4_K_M")
    engine = moestream.load(path, device="cpu", progress=False)
    try:
        first = engine.generate("The", moestream.SamplingParams(max_tokens=1)).tokens[0]
    finally:
        engine.close()

    def text(*flags: str) -> str:
        assert main(["run", "-m", path, "-p", "The", "-n", "8", "--device", "cpu", *flags]) == 0
        return capsys.readouterr().out

    greedy = text()
    assert text("-l", f"{first}-inf") != greedy
    assert text("--logit-bias", f"{first}-5", "-l", f"{first}+5") == greedy
    parsed = build_parser().parse_args(["run", "-m", "m.gguf", "-p", "hi", "-l", "7+1.5", "-l", "9-inf"])
    assert parsed.logit_bias == [(7, 1.5), (9, -math.inf)]
    for bad in ("7", "x+1", "7+", "7+-1"):
        with pytest.raises(SystemExit):
            main(["run", "-m", "m.gguf", "-p", "hi", "-l", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "TOKEN_ID+BIAS" in err[0], err


def test_serve_takes_llama_servers_prompt_cache_flags():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    serve = commands["serve"]
    a = serve.parse_args(["-m", "m.gguf"])
    assert (a.cache_prompt, a.cache_ram) == (True, 8192)  # llama-server's defaults
    a = serve.parse_args(["-m", "m.gguf", "--no-cache-prompt", "-cram", "0"])
    assert (a.cache_prompt, a.cache_ram) == (False, 0)
    assert serve.parse_args(["-m", "m.gguf", "--cache-ram", "-1"]).cache_ram == -1
