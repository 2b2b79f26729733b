"""Ctrl-C: exit 130 with one line, at start-up and mid-generation (then with a newline and the stats so far)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def spawn(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def test_interrupt_during_start_up(model_file):
    p = spawn("run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "4", "--device", "cpu")
    time.sleep(0.5)  # inside main, while torch and the model load
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130, text
    assert "Traceback" not in text and text.strip().splitlines()[-1] == "moestream: interrupted"


def test_interrupt_during_generation(model_file):
    argv = ["run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "4000", "-c", "4096", "--device", "cpu"]
    p = spawn(*argv)
    ready, _, _ = select.select([p.stdout], [], [], 60)
    assert ready, "no text came out"
    p.stdout.read1(1)  # some text is out: generation is under way
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130, text
    assert "Traceback" not in text and "stop: interrupted" in text
    assert text.strip().splitlines()[-1] == "moestream: interrupted"
    assert out.endswith(b"\n")
