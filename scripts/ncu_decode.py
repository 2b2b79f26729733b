"""Eager one-token decode steps with nothing else on the GPU, for Nsight Compute to profile the decode kernels
one launch at a time (the graphed step replays the same kernels):

    ncu --clock-control none --kernel-name-base function --kernel-name regex:'_gate_up|_matvec' \
        --launch-skip 10 --launch-count 5 --section SpeedOfLight --section Occupancy \
        python scripts/ncu_decode.py MODEL [STEPS]

(`scripts/gpu_session.sh ncu` runs it on the 8-layer slice.)
"""

from __future__ import annotations

import sys

import torch

import moestream

if __name__ == "__main__":
    engine = moestream.load(sys.argv[1], device="cuda", progress=False)
    engine.setup.capturing.one = False  # each kernel its own launch, as ncu replays them
    cache = engine.new_cache()
    engine.forward(list(range(1, 17)), cache)
    for t in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        engine.forward([(7 * t) % 1000 + 1], cache)
    torch.cuda.synchronize()
    engine.close()
