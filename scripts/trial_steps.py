"""Why --small-batch auto's trial of the cpu way says ~620 ms a step where `bench --small-batch cpu` runs 22 ms a
token (H100, qwen3-30b-a3b at -ncmoe 26): each trial step's time as the load takes it (no way given up early, no
remembered choice), then the same trial again once the load is over, longer.

    python scripts/trial_steps.py MODEL [moestream load flags as key=value, e.g. n_cpu_moe=26]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from moestream.offload import small_batch
from moestream.runtime.loader import load

AFTER = 20  # steps of each way timed after the load


def main() -> None:
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
    for way in setup.offload.ways():
        with setup._trial(way) as step:
            times = []
            for _ in range(AFTER):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
        print(f"  after the load: {way}: " + " ".join(f"{t:.1f}" for t in times) + " ms", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
