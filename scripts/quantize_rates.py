"""The generator's quantizer rates: MB of float32 weights encoded per second, one process, per type, and the
largest |error| of gguf's decoding of the blocks, on one gaussian matrix. --save / --against keep the blocks
of one run and compare another's with them byte for byte (a faster quantizer must write the same blocks)."""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np

from moestream.formats.quantize import QUANTIZABLE, quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3, help="runs per type; the best is reported")
    ap.add_argument("--types", help="comma-separated type names (default: every type the generator writes)")
    ap.add_argument("--save", help="write each type's blocks to this .npz")
    ap.add_argument("--against", help="compare each type's blocks with this .npz (from --save)")
    args = ap.parse_args()
    types = sorted(QUANTIZABLE) if args.types is None else [gguf.GGMLQuantizationType[t] for t in args.types.split(",")]
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype=np.float32)
    saved, old = {}, np.load(args.against) if args.against else None
    print(f"| type | MB/s | s | max abs error | rel RMS error |{' same bytes |' if old is not None else ''}")
    for qtype in types:
        seconds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            raw = quantize(x, qtype)
            seconds.append(time.perf_counter() - start)
        y = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(x.shape)
        err = np.abs(y - x)
        rel = float(np.sqrt(np.mean(err**2) / np.mean(x**2)))
        best = min(seconds)
        row = f"| {qtype.name} | {x.nbytes / 1e6 / best:.1f} | {best:.3f} | {err.max():.4g} | {rel:.4g} |"
        if old is not None:
            row += f" {np.array_equal(old[qtype.name], raw)} |"
        print(row, flush=True)
        saved[qtype.name] = raw
    if args.save:
        np.savez(args.save, **saved)


if __name__ == "__main__":
    main()
