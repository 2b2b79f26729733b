"""Why --small-batch auto's trial of the cpu way says ~620 ms a step where `bench --small-batch cpu` runs 22 ms a
token (H100, qwen3-30b-a3b at -ncmoe 26): each trial step's time as the load takes it (no way given up early, no
remembered choice), then the same trials again once the load is over, and the cpu way's again with one thread
fewer. A suspect: a trial step reads its token at once, so the waiting thread spins on a core (CUDA's default where
cores outnumber GPUs) beside the host function's OpenMP threads, one a core, and each of their parallel loops
waits for a descheduled thread. TRIAL_SYNC=blocking makes the wait sleep instead (the context's blocking sync).

    [TRIAL_SYNC=blocking] python scripts/trial_steps.py MODEL [load options as key=value, e.g. n_cpu_moe=26]
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import time

import torch

from moestream.kernels import host_swiglu
from moestream.offload import small_batch
from moestream.options import SmallBatch
from moestream.runtime.loader import load

AFTER = 12  # steps of each way timed after the load
BLOCKING_SYNC = 0x4  # CU_CTX_SCHED_BLOCKING_SYNC


def blocking_sync() -> None:
    """Make GPU 0's primary context wait for the GPU by sleeping (before torch makes it)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    for err in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), 0)):
        assert err == 0, f"CUresult {err}"
    assert cuda.cuDevicePrimaryCtxSetFlags(dev, BLOCKING_SYNC) == 0


def timed(setup, way: SmallBatch) -> str:
    with setup._trial(way) as step:
        times = []
        for _ in range(AFTER):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return " ".join(f"{t:.1f}" for t in times)


def main() -> None:
    if os.environ.get("TRIAL_SYNC") == "blocking":
        blocking_sync()
    path, flat = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
    flat = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in flat.items()}
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()  # nothing remembered: the load measures
    small_batch.OUT_OF_RACE = float("inf")  # every way runs all its steps
    record = small_batch.Timings.record

    def said(self, way, seconds: float) -> None:
        print(f"  in the load: {way} step {self.runs(way) + 1}: {seconds * 1e3:.1f} ms", flush=True)
        record(self, way, seconds)

    small_batch.Timings.record = said
    engine = load(path, small_batch="auto", **flat)
    small_batch.Timings.record = record
    setup = engine.setup
    print(f"  sync: {os.environ.get('TRIAL_SYNC', 'default')}, {torch.get_num_threads()} threads", flush=True)
    for way in setup.offload.ways():
        print(f"  after the load: {way}: {timed(setup, way)} ms", flush=True)
    if SmallBatch.CPU in setup.offload.ways():
        torch.set_num_threads(torch.get_num_threads() - 1)
        host_swiglu._buffers.clear()  # their argument blocks hold the thread count
        print(f"  after the load, {torch.get_num_threads()} threads: cpu: {timed(setup, SmallBatch.CPU)} ms")
    engine.close()


if __name__ == "__main__":
    main()
