"""Each quantized decode kernel of one layer (and the output head) timed alone, per tile setting: which
shapes are far from the HBM's rate, and which setting serves each best. Side by side in one process,
CUDA events after warm-up, on the model's stored weights (random inputs, never zeros).

    python scripts/matvec_shapes.py MODEL
"""

from __future__ import annotations

import sys

import torch
from decode_diag import kernel_cases  # scripts/ is on the path when run as a script

import moestream
from moestream.kernels import tuning

SETTINGS = {  # name: changes to the kernels' tuning (gate+up's blocks at once: the default unless set)
    "B1 r8": dict(blocks_at_once=1, gate_up_blocks_at_once=1),
    "B2 r8": dict(blocks_at_once=2, gate_up_blocks_at_once=2),
    "B4 r8": dict(blocks_at_once=4, gate_up_blocks_at_once=4),
    "B8 r8": dict(blocks_at_once=8, gate_up_blocks_at_once=8),
    "B1 r4 w2": dict(blocks_at_once=1, rows_per_program=4, warps=2),
    "B4 r4 w2": dict(blocks_at_once=4, rows_per_program=4, warps=2),
    "B8 r4 w4": dict(blocks_at_once=8, rows_per_program=4, warps=4),
    "B8 r2 w2": dict(blocks_at_once=8, rows_per_program=2, warps=2),
    "B2 r8 w8": dict(blocks_at_once=2, rows_per_program=8, warps=8),
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
            with tuning.use(**v):
                got = run().float()
                assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2, label
                row.append(time_us(run))
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
