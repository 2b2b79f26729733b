"""The kernels' tuning as one frozen object: every launch reads `current()` once and passes it down.

Scripts compare settings as whole processes (scripts/with_settings.py) or side by side in one
(scripts/decode_diag.py, matvec_shapes.py) through `use`; nothing sets a kernel module's globals. The
defaults come from sweeps on the H200 (docs/benchmarks.md, "Moved from code comments (kernels)").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tuning:
    # decode matvecs (kernels/matvec.py, moe_matvec.py)
    rows_per_program: int = 8  # output rows a program, halved (with the warps) until the grid fills the GPU
    warps: int = 4
    programs_per_sm: int = 2  # the grid a matvec launch aims for at least (0: no minimum)
    blocks_at_once: int = 1  # blocks of a row loaded as one tile: more costs registers once rows are unrolled
    gate_up_blocks_at_once: int = 1
    gate_up_warps: int = 4
    unrolled: int = 8  # rows of up to this many blocks are unrolled: longer ones spilled registers
    # `run` takes this until a decode step of the file has compiled `unrolled` on this machine (runtime/way_memory.py):
    # looped rows compile in half the time, for 1.5-3% of decode speed (benchmarks.md, thirty-first session)
    unrolled_cold: int = 0
    float_blocks_at_once: int = 16  # a float weight's (the router's) blocks of values a tile
    sum_block: int = 256  # output columns a program of the experts' weighted sum
    max_tokens: int = 4  # above this, dequantizing once and multiplying on the tensor cores is cheaper
    # decode attention (kernels/decode_attention.py)
    attention_min_chunk: int = 256  # keys a chunk holds at least: fewer and the combine's traffic dominates
    attention_target_programs: int = 256  # chunk programs to aim for on long buckets: about two an SM
    attention_bucket_steps: int = 8  # keys bucketed to a multiple of next_pow2(S) / 8: no half-empty chunk grid
    attention_combine_block: int = 16  # chunks the combine reads at a time
    # warps a chunk program: 8 hold its tiles without spilling and win where the grid leaves multiprocessors idle
    # (at most one program each); 4 win where two programs share one (benchmarks.md, thirty-fifth session)
    attention_chunk_warps: int = 4
    attention_spread_warps: int = 8
    attention_block_keys: int = 64  # keys a K and V tile holds at most (at 4 warps 64 spill registers, 32 do not)
    dequant_blocks_per_program: int = 8  # kernels/dequant.py: blocks a program expands
    # decode's gather of guessed experts on the side stream (offload/prefetch.py): a program waiting on the link
    # holds a multiprocessor that compute then lacks
    gather_programs: int = 16
    gather_words: int = 2048  # 32-bit words a program reads at once: what one program keeps in flight on the link
    # a decode step's kernels compiled side by side (a throwaway capture of it) before its first pass runs; off:
    # on the H100 part of the step still compiled serially and a first run did not get faster (benchmarks.md)
    compile_ahead: bool = False
    # programmatic dependent launch of the decode kernels (sm_90 and later; never under Triton's interpreter)
    pdl: bool = True


_current = Tuning()


def current() -> Tuning:
    """The tuning launches use now."""
    return _current


@contextlib.contextmanager
def use(**changes) -> Iterator[Tuning]:
    """The current tuning with `changes` (field=value) while the block runs, as launches made in it see it."""
    global _current
    before = _current
    _current = replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
