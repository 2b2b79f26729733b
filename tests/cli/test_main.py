"""The command's first words: a line on stderr saying what it does, before the slow imports."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "-m", "MODEL", "-p", "hi", "-n", "1", "--device", "cpu"], ["run: loading", "then generating 1 token"]),
        (["info", "MODEL"], ["info: reading"]),
        (["bench", "-m", "MODEL", "-p", "8,16", "-n", "2", "-r", "1", "--device", "cpu"], ["1 placement x 3 tests"]),
        (["profile", "-m", "MODEL", "-p", "16", "--device", "cpu"], ["profile: loading", "pp16 under serial"]),
        (["probe", "MODEL", "--device", "cpu"], ["probe: timing"]),
        (["serve", "-m", "MODEL", "--port", "PORT", "--device", "cpu"], ["serve: loading", "http://127.0.0.1:"]),
        (["warmup", "-m", "MODEL", "--device", "cpu"], ["warmup: compiling"]),
        (["make-model", "OUT", "--preset", "tiny"], ["make-model: writing", "preset tiny"]),
    ],
)
def test_a_line_saying_what_it_does_comes_first_and_at_once(model_file, tmp_path, argv, words):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    given = {"MODEL": model_file("tiny", "F32"), "PORT": port, "OUT": str(tmp_path / "out.gguf")}
    argv = [given.get(a, a) for a in argv]
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own group: make-model's workers go with it
    )
    try:
        ready, _, _ = select.select([p.stderr], [], [], 10)
        elapsed = time.perf_counter() - t0
        assert ready, "nothing on stderr"
        line = p.stderr.readline().decode()
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # only the first line matters
        p.communicate(timeout=60)
    assert line.startswith("moestream: ") and all(w in line for w in words), line
    assert elapsed < 2.0, f"{elapsed:.2f} s"  # about 0.2 s on an idle dev machine: torch is not imported yet


COMMANDS = ["run", "bench", "profile", "probe", "serve", "info", "make-model"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_explains_every_flag_and_names_each_default_once(command):
    import argparse
    import re

    from moestream.cli.llama import _Refused
    from moestream.cli.main import build_parser

    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in parser._actions:
        if not isinstance(action, _Refused | argparse._HelpAction | argparse._VersionAction):
            assert action.help, f"{command} {action.option_strings or action.dest}: no help"
    text = " ".join(parser.format_help().split())
    assert not re.search(r"default[^()]*\) \(default", text), text
    assert "(default: None)" not in text and "(default: False)" not in text
    if command == "make-model":
        assert "qwen3-30b-a3b" in text and "tiny" in text  # the preset names


def test_the_description_says_what_moestream_is_for(capsys):
    """It was the module's docstring (how the command parses flags), not what the program does."""
    from moestream.cli.main import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Mixture-of-Experts GGUF models bigger than the GPU" in text and "make-model tiny.gguf" in text
    assert "parse flags" not in text


def test_one_of_a_thing_is_said_in_the_singular(model_file, capsys):
    """One streamed layer of two: '1 layer's experts', '1 staging slot', not '1 layers'', '1 staging slots'."""
    from moestream.cli.main import main

    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "1", "--device", "cpu", "-ncmoe", "1"]
    assert main([*argv, "--slots", "5"]) == 0
    err = capsys.readouterr().err
    assert "--slots 5: 1 staging slot, as many as layers stream" in err
    assert "placement: 1 layer's experts on the device" in err and "staging: 1 slot x" in err


def test_version():
    from moestream import __version__

    for argv in (["--version"], ["run", "--version"]):
        r = subprocess.run([sys.executable, "-m", "moestream.cli", *argv], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == f"moestream {__version__}"


def test_the_stats_line_gives_no_rate_for_no_decode_step(model_file, capsys):
    """-n 1: the token comes from the prompt's pass, so there is no decode rate (it said 23055.3 tok/s)."""
    from moestream.cli.main import main

    path = model_file("tiny", "F32")
    assert main(["run", "-m", path, "-p", "hi", "-n", "1", "--device", "cpu"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "generated 1 token |" in line and "tok/s" not in line and "prompt 1 token in" in line
    assert re.match(r"load \d+\.\d\d s \| prompt", line)  # the load's seconds first, as llama.cpp says them
    assert main(["run", "-m", path, "-p", "hi", "-n", "3", "--device", "cpu", "--ignore-eos"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "generated 3 tokens, " in line and "tok/s over 2 steps" in line


def test_fewer_slots_than_asked_are_said(model_file, capsys):
    """--slots 5 with two streamed layers makes two slots: said, not silent."""
    from moestream.cli.main import main

    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "1", "--device", "cpu", "-ncmoe", "all"]
    assert main([*argv, "--slots", "5"]) == 0
    err = capsys.readouterr().err
    assert "--slots 5: 2 staging slots, as many as layers stream" in err
    assert "experts:" not in err  # no bar of resident layers when none is (it read 'experts: 0layer')


def test_a_temperature_too_small_to_divide_by_runs_greedy(model_file, capsys):
    """--temp 1e-300 is 0 in float32: it died with a traceback (NaN probabilities); now the greedy answer."""
    from moestream.cli.main import main

    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "6", "--device", "cpu", "--ignore-eos"]
    assert main([*argv, "--temp", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*argv, "--temp", "1e-300", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy


def test_a_warning_is_said_once(model_file):
    """--vram-budget on the CPU warns; the options are settled twice on the way to the engine, and it said it twice."""
    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "1", "--device", "cpu", "--vram-budget", "1GiB"]
    r = subprocess.run([sys.executable, "-m", "moestream.cli", *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("only decides which layers stream") == 1, r.stderr
