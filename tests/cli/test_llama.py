"""llama.cpp command lines: flags accepted with their meaning, the rest refused in one line naming ours, and
`bench -o` under llama-bench's field names."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import moestream
from moestream.cli.args import REJECTED, engine_options
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


@pytest.mark.parametrize("group", list(REJECTED))
def test_other_llama_flags_get_one_line_naming_ours(capsys, group):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "-m", "m.gguf", "-p", "hi", group[0], "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert group[0] in err[0] and REJECTED[group] in err[0]


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
