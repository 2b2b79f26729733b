"""Decode's reads of streamed experts over the link, alone: GB/s of the gather kernels reading page-locked file
pages at their host address (as decode does: no host sync) beside a DMA copy of the same bytes (the link's floor).

A layer's stacks in qwen3-30b-a3b's Q4_K shapes (gate, up, down: 884736 bytes an expert each, 128 experts), random
bytes in a file mapped and page-locked as the engine holds a model; each call reads other experts than the calls
around it (the GPU's L2 would otherwise serve repeats). Rows: the side stream's gather (`_gather_few_kernel`) on P
programs, each reading a chunk of 8 or 32 KiB at once (what a program keeps in flight), with 16-byte and 4-byte
loads; the full grid (a program a pick and 8 KiB chunk: the misses' way); DMA.

    python scripts/gather_rate.py [--experts 8,28] [--programs 16,32,64,132] [--words 2048,8192]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import warnings

import numpy as np
import torch
from matvec_shapes import time_us  # scripts/ is on the path when run as a script

from moestream.kernels import gather, tuning
from moestream.offload.host import PinnedRanges

EXPERT_BYTES, N_EXPERT, STACKS = 884736, 128, 3  # 768 x 2048 in Q4_K (144-byte blocks of 256): qwen3-30b-a3b


def host_stacks(path: str) -> tuple[list[torch.Tensor], PinnedRanges, np.memmap]:
    """Three [N_EXPERT, EXPERT_BYTES] stacks of random bytes in a read-only, page-locked mapping of path."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(STACKS):
            f.write(rng.integers(0, 256, N_EXPERT * EXPERT_BYTES, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    pinned = PinnedRanges()
    if not pinned.register([mapped]):
        raise SystemExit("page-locking the file was refused: raise ulimit -l")
    with warnings.catch_warnings():  # a read-only mapping, read only
        warnings.simplefilter("ignore")
        flat = torch.from_numpy(mapped)
    size = N_EXPERT * EXPERT_BYTES
    return [flat[s * size : (s + 1) * size].view(N_EXPERT, -1) for s in range(STACKS)], pinned, mapped


def rates(stacks: list[torch.Tensor], n: int, programs: list[int], chunks: list[int], reps: int) -> dict[str, float]:
    """GB/s of each way of reading n experts of every stack, a different n each call of a cycle through them all."""
    calls = N_EXPERT // n
    sets = torch.randperm(N_EXPERT * calls, generator=torch.Generator().manual_seed(n))[: calls * n] % N_EXPERT
    ids = sets.view(calls, n).cuda()
    words = EXPERT_BYTES // 4
    offs = ids * words  # word offsets from a stack's base: the side stream's form (AT)
    outs = [torch.empty((n, EXPERT_BYTES), dtype=torch.uint8, device="cuda") for _ in stacks]
    pick = gather.RowGather()
    cycle = itertools.count()
    nbytes = STACKS * n * EXPERT_BYTES

    def each_call(read) -> float:
        def run() -> None:
            j = next(cycle) % calls
            for src, out in zip(stacks, outs, strict=True):
                read(j, src, out)

        try:
            return nbytes / (time_us(run, calls=calls, reps=reps) * 1e3)  # bytes / ns = GB/s
        except Exception as e:  # one way failing (say a copy CUDA graphs refuse) leaves the others' rows
            print(f"failed: {type(e).__name__}: {e}")
            return float("nan")

    out: dict[str, float] = {}
    for w in chunks:
        with tuning.use(gather_words=w):
            for p, quads in [(p, q) for p in programs for q in ((True, False) if w == chunks[0] else (True,))]:
                name = f"side gather, {p} programs of {4 * w // 1024} KiB, {16 if quads else 4}-byte loads"
                out[name] = each_call(lambda j, src, o, p=p, q=quads: pick._few(src, offs[j], o, p, at=True, quads=q))
    out["full grid (a program a pick and chunk)"] = each_call(lambda j, src, o: pick(src, ids[j], out=o))
    first = ids[:, 0].tolist()  # DMA needs the host to know the rows: n experts in a row from each set's first

    def dma(j: int, src: torch.Tensor, o: torch.Tensor) -> None:
        e = min(first[j], N_EXPERT - n)
        o.copy_(src[e : e + n], non_blocking=True)

    out["DMA copy of as many contiguous bytes"] = each_call(dma)
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,28", help="experts read a call from each stack (8: one row; 28: 4 rows)")
    p.add_argument("--programs", default="16,32,64,132")
    p.add_argument("--words", default="2048,8192", help="32-bit words a side-gather program reads at once")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    print(torch.cuda.get_device_name(), "| torch", torch.__version__)
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    try:
        stacks, pinned, mapped = host_stacks(path)
        try:
            for n in ints(a.experts):
                mb = STACKS * n * EXPERT_BYTES / 1e6
                ways = rates(stacks, n, ints(a.programs), ints(a.words), a.reps)
                for name, gbs in ways.items():
                    print(f"{n:>3} experts x {STACKS} stacks ({mb:6.1f} MB) {name:<44} {gbs:7.2f} GB/s")
        finally:
            torch.cuda.synchronize()
            pinned.unregister()
            del mapped
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
