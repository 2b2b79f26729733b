"""Run a moestream command with kernel module settings changed, so that settings can be compared as whole
processes side by side (the in-process sweep drifts with its order; separate processes on the whole model
agreed within 0.5%), without a worktree per setting.

    python scripts/with_settings.py qmatvec.UNROLLED=0 qmatvec.WARPS=2 -- bench -m MODEL -p 0 -n 128
"""

from __future__ import annotations

import ast
import importlib
import sys

from moestream.cli.main import main


def apply(settings: list[str]) -> None:
    """Each 'module.NAME=value' (a module of moestream.kernels, a Python literal) set before anything runs."""
    for item in settings:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(f"moestream.kernels.{module}")
        if not hasattr(mod, name):
            raise SystemExit(f"moestream.kernels.{module} has no setting {name}")
        setattr(mod, name, ast.literal_eval(value))


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit("usage: with_settings.py [module.NAME=value ...] -- moestream arguments")
    cut = args.index("--")
    apply(args[:cut])
    sys.exit(main(args[cut + 1 :]))
