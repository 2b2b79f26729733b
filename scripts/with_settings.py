"""Run a moestream command with the kernels' tuning changed (fields of kernels/tuning.py's Tuning), so that
settings can be compared as whole processes side by side (the in-process sweep drifts with its order; separate
processes on the whole model agreed within 0.5%), without a worktree per setting.

    python scripts/with_settings.py unrolled=0 warps=2 -- bench -m MODEL -p 0 -n 128
"""

from __future__ import annotations

import ast
import dataclasses
import sys

from moestream.cli.main import main
from moestream.kernels import tuning


def changes(settings: list[str]) -> dict:
    """Each 'field=value' (a field of the kernels' Tuning, a Python literal) as use()'s keyword arguments."""
    known = [f.name for f in dataclasses.fields(tuning.Tuning)]
    out = {}
    for item in settings:
        name, _, value = item.partition("=")
        if name not in known:
            raise SystemExit(f"the kernels' tuning has no field {name!r} (fields: {', '.join(known)})")
        out[name] = ast.literal_eval(value)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit("usage: with_settings.py [field=value ...] -- moestream arguments")
    cut = args.index("--")
    with tuning.use(**changes(args[:cut])):
        code = main(args[cut + 1 :])
    sys.exit(code)
