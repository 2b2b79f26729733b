"""Ctrl-C: exit 130 with one line, at start-up and mid-generation (then with a newline and the stats so far)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch


def default_sigint() -> None:
    """A command started from a terminal takes Ctrl-C; one started in the background of a script (as this suite
    may be) inherits an ignored SIGINT, and a command rightly leaves that ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=default_sigint,
    )


@pytest.mark.parametrize("delay", [0.35, 0.5, 0.7, 1.0, 1.5])
def test_interrupt_during_start_up(model_file, delay):
    """At several moments of start-up (imports, then the model load): one line and exit 130. An interrupt
    inside an import once left numpy half-initialised and the run died with a traceback (1 in ~6 at 0.5 s).
    -n 4000: where start-up ends before the signal, it lands in generation, where the same must hold."""
    p = spawn("run", "-m", model_file("tiny", "F32"), "-p", "hi", "-n", "4000", "-c", "4096", "--device", "cpu")
    time.sleep(delay)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_interrupt_mid_generation_unregisters_host_memory(model_file, monkeypatch, capsys):
    """Ctrl-C while tokens stream: exit 130, and the page-locked expert ranges are released (CUDA refuses to
    register pages that are still registered, so registering them again proves it)."""
    import builtins

    from moestream.cli.main import main
    from moestream.formats.gguf import GGUFFile
    from moestream.offload.host import PinnedRanges

    path = model_file("tiny", "Q4_K_M")
    real_print, pieces = builtins.print, []

    def print_then_interrupt(*args, **kwargs):
        if kwargs.get("end") == "" and kwargs.get("flush"):  # a piece of generated text
            pieces.append(args)
            if len(pieces) == 3:
                raise KeyboardInterrupt
        real_print(*args, **kwargs)

    monkeypatch.setattr(builtins, "print", print_then_interrupt)
    argv = ["run", "-m", path, "-p", "hi", "-n", "200", "--device", "cuda", "-ncmoe", "all"]
    assert main([*argv, "--small-batch", "gather"]) == 130
    monkeypatch.setattr(builtins, "print", real_print)
    assert "stop: interrupted" in capsys.readouterr().err
    with GGUFFile(path) as f:
        pins = PinnedRanges()
        assert pins.register([t.data for t in f.tensors.values() if "_exps" in t.name])
        pins.unregister()


def test_interrupts_held_until_the_block_ends():
    from moestream.cli.main import interrupts_held

    reached = False
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored in a suite run in the background
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)  # a real signal to this process
                time.sleep(0.05)  # the handler runs here; the block goes on
                reached = True
        assert reached
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the previous handler is back
    finally:
        signal.signal(signal.SIGINT, before)


def test_serve_answers_on_the_socket_it_bound_and_stops_on_ctrl_c(model_file):
    """`moestream serve` binds its socket before the load and hands it to uvicorn: /health answers there, and
    Ctrl-C drains and exits 130 with one line, as run does."""
    import socket
    import urllib.request

    with socket.socket() as s:  # a free port (released before the server binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = spawn("serve", "-m", model_file("tiny", "Q4_K_M"), "--device", "cpu", "--port", str(port))
    try:
        deadline, health = time.time() + 90, None
        while health is None and time.time() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = r.read()
            except OSError:
                time.sleep(0.3)
        assert health is not None and b"ok" in health, p.stderr.read1().decode() if p.poll() is not None else ""
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    text = err.decode()
    assert p.returncode == 130 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1] == "moestream: interrupted"


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (zombies are gone already: they hold no memory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields[0]: state, fields[2]: process group
                found.append(int(entry))
    return found


@pytest.mark.parametrize(("settle", "how"), [(0.0, "ctrl-c"), (1.0, "ctrl-c"), (1.0, "parent killed")])
def test_make_model_leaves_no_worker_behind(tmp_path, settle, how):
    """Ctrl-C at a terminal signals the whole group (the writer and its workers): exit 130, one line, no
    traceback (workers just forked printed BrokenPipeErrors), no worker left; and workers die with a writer
    that is killed outright (one ran on, orphaned, for half an hour)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", "make-model", str(tmp_path / "m.gguf"), "--preset", "qwen3-30b-a3b"]
        + ["--layers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,  # its own group, as a shell gives a foreground job
        preexec_fn=default_sigint,
    )
    try:
        deadline = time.time() + 120
        while len(_group(p.pid)) < 2 and time.time() < deadline and p.poll() is None:
            time.sleep(0.01)  # until the first worker is forked
        assert len(_group(p.pid)) >= 2, "no worker process was started"
        time.sleep(settle)  # 0: as the workers start; 1 s: while they make chunks
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.kill()
        out, err = p.communicate(timeout=60)
        time.sleep(1.0)  # a killed worker's exit
        left = _group(p.pid)
    finally:
        if _group(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
    assert left == []
    if how == "ctrl-c":
        text = err.decode()
        assert p.returncode == 130, text
        assert "Traceback" not in text and "Error" not in text, text
        assert text.strip().splitlines()[-1] == "moestream: interrupted"
        assert not (tmp_path / "m.gguf").exists()
