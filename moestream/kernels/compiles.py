"""Kernels compiled at first use on this machine (Triton's, and the C matvec of kernels/cpu_quant.py): the first
compile says so once on stderr, each is counted, and `summary` sums them up when a stretch of work ends (load,
warmup, a run). A fresh machine's first load can spend a minute here; without a word it looks hung.

The count is the process's, as the caches it fills are the machine's: one engine or several, a kernel compiles
once. Triton tells us through its compilation listener, chained after any listener already installed.
`side_by_side` compiles a pass's Triton kernels on a pool of threads instead of one by one at first launch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

FIRST = "moestream: compiling kernels (first use on this machine; kept for later runs) ..."


@dataclass
class Tally:
    """Compiles since the last summary, and whether the first-use line was said (once a process)."""

    count: int = 0
    seconds: float = 0.0
    said: bool = False
    each: list[tuple[float, str]] = field(default_factory=list)  # (seconds, kernel) of each compile


_TALLY = Tally()
_LOCK = threading.Lock()  # Triton may compile on worker threads (its async mode)


def compiling(out: TextIO | None = None) -> None:
    """A compile starts (or a Triton one just finished): say so once a process."""
    with _LOCK:
        if _TALLY.said:
            return
        _TALLY.said = True
    print(FIRST, file=out or sys.stderr, flush=True)


LONGEST = 3  # compiles a summary names, the longest first: where a fresh machine's first run waits


def compiled(seconds: float, name: str = "a kernel") -> None:
    """One kernel was compiled (not found in its cache), in `seconds`."""
    with _LOCK:
        _TALLY.count += 1
        _TALLY.seconds += seconds
        _TALLY.each.append((seconds, name))


def summary(out: TextIO | None = None) -> int:
    """Say how many kernels were compiled since the last summary (nothing when none); returns that count."""
    with _LOCK:
        count, seconds, each = _TALLY.count, _TALLY.seconds, _TALLY.each
        _TALLY.count, _TALLY.seconds, _TALLY.each = 0, 0.0, []
    if count:
        s = "s" * (count != 1)
        longest = ""
        if count > 1:
            top = sorted(each, reverse=True)[:LONGEST]
            longest = "; longest: " + ", ".join(f"{name} {t:.1f} s" for t, name in top)
        print(
            f"moestream: compiled {count} kernel{s} in {seconds:.1f} s (cached: later runs skip this){longest}",
            file=out or sys.stderr,
            flush=True,
        )
    return count


def compile_seconds(times) -> float:
    """The seconds of one compile, from the times Triton's listener is given (in microseconds)."""
    return (times.ir_initialization + sum(t for _, t in times.lowering_stages) + times.store_results) / 1e6


def triton_listener(*, src, metadata, metadata_group, times, cache_hit: bool, _chained=None) -> None:
    """Triton's compilation listener: a compile that missed the disk cache is said and counted."""
    if not cache_hit:
        compiling()
        compiled(compile_seconds(times), getattr(src, "name", None) or "a kernel")
    if _chained is not None:
        _chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)


def watch_triton(triton) -> None:
    """Install triton_listener (once; keeping a listener someone else installed)."""
    knobs = triton.knobs.compilation
    current = knobs.listener
    if getattr(current, "moestream", False):
        return

    def listener(**kw) -> None:
        triton_listener(**kw, _chained=current)

    listener.moestream = True
    knobs.listener = listener


_AHEAD = threading.local()  # .on: this thread is inside side_by_side
_AHEAD_LOCK = threading.Lock()  # one block at a time: it swaps Triton's launch for its length


@contextlib.contextmanager
def side_by_side(triton, workers: int | None = None) -> Iterator[None]:
    """Triton launches on this thread inside the block launch nothing: each kernel not yet loaded is handed to a
    pool of threads to compile (or to load from the disk cache), and the block's end waits for them all. Meant
    for a pass recorded in a CUDA graph capture, which runs nothing anyway: its kernels are then ready, compiled
    side by side (compiling releases the GIL), before the pass that runs. A kernel that fails to compile here is
    compiled again at its launch, which then says why."""
    from triton.runtime.jit import JITFunction

    if getattr(_AHEAD, "on", False) or not _AHEAD_LOCK.acquire(blocking=False):
        yield  # nested, or another thread's block is open: compile at first launch as usual
        return
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=warmup or getattr(_AHEAD, "on", False), **kwargs)

    pool = ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="moestream-compile")
    try:
        with triton.AsyncCompileMode(pool, ignore_errors=True):  # its end waits for the compiles it was given
            _AHEAD.on, JITFunction.run = True, compile_only
            try:
                yield
            finally:
                _AHEAD.on, JITFunction.run = False, launch
    finally:
        pool.shutdown()
        _AHEAD_LOCK.release()


def cache_dirs() -> dict[str, str]:
    """Where compiled kernels are kept: Triton's cache, torch inductor's, and the C matvec's."""
    dirs = {}
    try:
        import triton

        dirs["triton"] = str(triton.knobs.cache.dir)
    except ImportError:
        dirs["triton"] = "(Triton is not installed)"
    try:  # where torch.compile would keep its kernels (cache_dir() itself would also create the folder)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        dirs["torch inductor"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    except ImportError:
        dirs["torch inductor"] = "(unknown in this torch)"
    dirs["C matvec"] = str(c_cache_dir())
    return dirs


def c_cache_dir() -> Path:
    """The C matvec's build folder (kernels/cpu_quant.py): $XDG_CACHE_HOME/moestream or ~/.cache/moestream."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moestream"
