"""Run a command and say, on stderr, how long after its start its first byte of standard output came (the first
generated text of `moestream run`, whose other lines go to stderr): a first run's time to first token, the
process start (imports, load, compiles, prompt) included. Output passes through unchanged; with --stamp each of
the command's stderr lines is prefixed with its seconds since the start (where a first run's time goes).

    python scripts/first_output.py [--stamp] moestream run -m MODEL -p TEXT -n 16
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def stamped(stream, start: float) -> None:
    """Copy the child's stderr to ours, each line led by the seconds since the start; of a progress bar's
    carriage-return updates only what a terminal would show last."""
    for line in iter(stream.readline, b""):
        line = line.rsplit(b"\r", 1)[-1]
        if not line.strip():
            continue
        sys.stderr.buffer.write(f"[{time.perf_counter() - start:7.2f} s] ".encode() + line)
        sys.stderr.buffer.flush()


def main(cmd: list[str], stamp: bool = False) -> int:
    start = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if stamp else None) as child:
        copier = threading.Thread(target=stamped, args=(child.stderr, start), daemon=True) if stamp else None
        if copier:
            copier.start()
        first = child.stdout.read(1)
        if first:
            print(f"first output {time.perf_counter() - start:.2f} s after start", file=sys.stderr, flush=True)
        sys.stdout.buffer.write(first)
        sys.stdout.buffer.write(child.stdout.read())
        if copier:
            copier.join()
    return child.returncode


if __name__ == "__main__":
    args = sys.argv[1:]
    stamp = bool(args) and args[0] == "--stamp"
    if len(args) < 1 + stamp:
        raise SystemExit("usage: first_output.py [--stamp] COMMAND [ARGS...]")
    sys.exit(main(args[stamp:], stamp))
