"""Each quantized decode kernel of one layer (and the output head) timed alone, per tile setting: which
shapes are far from the HBM's rate, and which setting serves each best. Side by side in one process,
CUDA events after warm-up, on the model's stored weights (random inputs, never zeros).

    python scripts/matvec_shapes.py MODEL
"""

from __future__ import annotations

import sys

import torch
from decode_diag import OLD_Q6_K, kernel_cases  # scripts/ is on the path when run as a script

import moestream
from moestream.kernels import qmatvec

SETTINGS = {  # name: qmatvec module settings (gate+up's blocks at once: 1 unless set)
    "B1 r8": dict(BLOCKS_AT_ONCE=1, GATE_UP_BLOCKS_AT_ONCE=1),
    "B2 r8": dict(BLOCKS_AT_ONCE=2, GATE_UP_BLOCKS_AT_ONCE=2),
    "B4 r8": dict(BLOCKS_AT_ONCE=4, GATE_UP_BLOCKS_AT_ONCE=4),
    "B8 r8": dict(BLOCKS_AT_ONCE=8, GATE_UP_BLOCKS_AT_ONCE=8),
    "B1 r4 w2": dict(BLOCKS_AT_ONCE=1, ROWS_PER_PROGRAM=4, WARPS=2),
    "B4 r4 w2": dict(BLOCKS_AT_ONCE=4, ROWS_PER_PROGRAM=4, WARPS=2),
    "B8 r4 w4": dict(BLOCKS_AT_ONCE=8, ROWS_PER_PROGRAM=4, WARPS=4),
    "B8 r2 w2": dict(BLOCKS_AT_ONCE=8, ROWS_PER_PROGRAM=2, WARPS=2),
    "B2 r8 w8": dict(BLOCKS_AT_ONCE=2, ROWS_PER_PROGRAM=8, WARPS=8),
    "B4 oldQ6": dict(BLOCKS_AT_ONCE=4, GATE_UP_BLOCKS_AT_ONCE=1, **OLD_Q6_K),  # the defaults, Q6_K's dot before
    "B2 oldQ6": dict(BLOCKS_AT_ONCE=2, GATE_UP_BLOCKS_AT_ONCE=2, **OLD_Q6_K),
}


def time_us(run, calls: int = 50, reps: int = 10) -> float:
    """GPU time a call: `calls` launches captured in one CUDA graph and replayed, so Python's launch cost,
    which a graphed decode step does not pay, is not what is timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()  # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (reps * calls) * 1e3


def main(path: str) -> None:
    e = moestream.load(path, device="cuda", progress=False)
    print(f"{'kernel':<48} {'MB':>6} " + " ".join(f"{n:>9}" for n in SETTINGS))
    for label, nbytes, run in kernel_cases(e):
        ref = run().float()
        row = []
        for v in SETTINGS.values():
            saved = {k: getattr(qmatvec, k) for k in v}
            for k, val in v.items():
                setattr(qmatvec, k, val)
            got = run().float()
            assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2, label
            row.append(time_us(run))
            for k, val in saved.items():
                setattr(qmatvec, k, val)
        best = min(row)
        print(
            f"{label:<48} {nbytes / 1e6:6.2f} "
            + " ".join(f"{us:9.2f}" for us in row)
            + f"  best {nbytes / best / 1e6:.2f} TB/s",
            flush=True,
        )
    print("(us a call; MB: bytes the kernel reads)")
    e.close()


if __name__ == "__main__":
    main(sys.argv[1])
