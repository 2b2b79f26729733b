"""How far each KV cache type moves the logits from the f16 cache's on the tiny models (issue 36's bounds: q8_0
1e-2, q4_0 3e-2 of the largest logit), and why: per preset and type, the worst and median token, the tokens
whose experts changed in some layer, the worst token past position 8 routed as with f16, and K or V alone
quantized. The setting of tests/runtime/test_kv_types.py (40 prompt tokens, -ub 8, Q8_0 weights, seed 1).

    python scripts/kv_error.py [PRESET...]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model
from tests.runtime.test_kv_types import PRESETS, relative_errors, run


def main(presets: list[str]) -> None:
    print("| preset | type | max | median | tokens rerouted | max past 8, same route | K alone | V alone |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = str(Path(tmp) / f"{preset}.gguf")
            make_model(path, get_preset(preset), quant="Q8_0", seed=1, progress=False)
            ref, _, ref_picks = run(path, "f16", n_gen=0)
            for kv in ("q8_0", "q4_0"):
                logits, _, picks = run(path, kv, n_gen=0)
                err = relative_errors(logits, ref)
                same = torch.stack([(picks[il] == ref_picks[il]).all(dim=-1) for il in ref_picks]).all(dim=0)
                alone = [
                    relative_errors(run(path, kv, n_gen=0, **{f"cache_type_{other}": "f16"})[0], ref).max()
                    for other in ("v", "k")  # K alone quantized, then V alone
                ]
                print(
                    f"| {preset} | {kv} | {err.max():.4f} | {err.median():.4f} | {int((~same).sum())}/{len(err)} | "
                    f"{err[8:][same[8:]].max():.4f} | {alone[0]:.4f} | {alone[1]:.4f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1:] or PRESETS)
