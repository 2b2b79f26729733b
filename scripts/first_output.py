"""Run a command and say, on stderr, how long after its start its first byte of standard output came (the first
generated text of `moestream run`, whose other lines go to stderr): a first run's time to first token, the
process start (imports, load, compiles, prompt) included. Output passes through unchanged.

    python scripts/first_output.py moestream run -m MODEL -p TEXT -n 16
"""

from __future__ import annotations

import subprocess
import sys
import time


def main(cmd: list[str]) -> int:
    start = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as child:
        first = child.stdout.read(1)
        if first:
            print(f"first output {time.perf_counter() - start:.2f} s after start", file=sys.stderr, flush=True)
        sys.stdout.buffer.write(first)
        sys.stdout.buffer.write(child.stdout.read())
    return child.returncode


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: first_output.py COMMAND [ARGS...]")
    sys.exit(main(sys.argv[1:]))
