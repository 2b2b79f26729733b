"""--small-batch auto's choices kept between loads. Which way a placement's small batches take depends on the file,
the options and the machine, and timing the ways again cost every later load seconds (docs/benchmarks.md). A load
of the same file (path, size, modification time) with the same options on the same machine and versions takes the
choice it made before; deleting the file measures again.

The same file keeps which row unrollings (kernels/tuning.py's `unrolled`) a decode step of each model file has
compiled on this machine: unrolled rows take twice as long to compile, so `run` takes them only once compiled."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch

from moestream.kernels.compiles import c_cache_dir
from moestream.offload.small_batch import Measured
from moestream.options import Options, SmallBatch

FILE_NAME = "small-batch.json"
KEEP = 256  # choices kept (bench sweeps make one a placement)


def memory_file() -> Path:
    """Where the choices are kept: beside the C matvec's builds ($XDG_CACHE_HOME/moestream or ~/.cache/moestream)."""
    return c_cache_dir() / FILE_NAME


def file_identity(path: str | os.PathLike[str]) -> str:
    """A model file as the memory knows it: rewritten in place, it is another file."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def _machine(options: Options) -> list:
    device = options.model.torch_device
    gpu = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = [props.name, props.total_memory]
    return [platform.node(), os.cpu_count(), gpu, torch.__version__, _code()]


@functools.cache
def _code() -> str:
    """This moestream: its version and a hash of its code (a source tree on PYTHONPATH has no installed version, and
    an edit there may change which way is fastest)."""
    try:
        version = importlib.metadata.version("moestream")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".c", ".h")):
        digest.update(path.read_bytes())
    return f"{version} {digest.hexdigest()[:16]}"


def key(file_id: str, options: Options, tried: list[SmallBatch]) -> str:
    """What a choice was made for: the file, every option but progress output and whether to measure, the machine,
    the ways tried."""
    options = options.replace(progress=False, measure_ways=True)
    what = [file_id, repr(options), _machine(options), [str(w) for w in tried]]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def _entries() -> dict:
    """The choices kept (none where the file is missing, unreadable or damaged)."""
    try:
        entries = json.loads(memory_file().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def recall(k: str) -> Measured | None:
    """The choice made under k before, if any (a damaged entry is none)."""
    try:
        entry = _entries()[k]
        seconds = {SmallBatch(w): float(s) for w, s in entry["seconds"].items()}
        chosen = SmallBatch(entry["chosen"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    note = f"remembered from an earlier load; delete {memory_file()} to measure again"
    return Measured(chosen, seconds, note=note)


def remember(k: str, measured: Measured) -> None:
    """Keep measured under k (best effort: a cache that cannot be written only costs the next load a measurement)."""
    _keep(k, {"chosen": str(measured.chosen), "seconds": {str(w): s for w, s in measured.seconds.items()}})


def rows_key(file_id: str, options: Options) -> str:
    """What a decode step's kernels were compiled for: the file's shapes and types on this machine and code (the
    placement options only add kernels beside them)."""
    return hashlib.sha256(json.dumps(["compiled rows", file_id, _machine(options)]).encode()).hexdigest()


def rows_compiled(k: str) -> list[int]:
    """The row unrollings a decode step compiled under k (none where unknown or damaged)."""
    try:
        return [int(u) for u in _entries()[k]["unrolled"]]
    except (KeyError, TypeError, ValueError):
        return []


def remember_rows(k: str, unrolled: int) -> None:
    """A decode step compiled its kernels with rows of up to `unrolled` blocks unrolled, under k."""
    kept = rows_compiled(k)
    if unrolled not in kept:
        _keep(k, {"unrolled": [*kept, unrolled]})


def _keep(k: str, entry: dict) -> None:
    path, entries = memory_file(), _entries()
    entries.pop(k, None)  # newest last: the oldest go first past KEEP
    entries[k] = entry
    entries = dict(list(entries.items())[-KEEP:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)  # another process's load sees the old file or the new one, never half of one
    except OSError:
        pass
