"""Measure a preset's trained routing on a scaled-down file (trained_routing.calibration_preset: the preset's
experts, head sizes, rope and routing settings; hidden 256, expert FFN 64): per layer, then the means, on the
shipped English text.

Usage: python scripts/routing_calibration.py PRESET LAYERS [field=value ...]   (fields of RoutingSettings to try)
"""

from __future__ import annotations

import ast
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import moestream
from moestream.tools import trained_routing
from moestream.tools.routing_stats import report_lines, routing_report
from moestream.tools.synthetic import make_model
from moestream.tools.tokens import text_tokens
from moestream.tools.trained_routing import calibration_preset


def main(name: str, layers: int, **fields) -> None:
    if fields:
        trained_routing.ROUTING[name] = replace(trained_routing.ROUTING[name], **fields)
    p = calibration_preset(name, layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scaled.gguf"
        make_model(path, p, quant="F32", progress=False, routing="trained")
        engine = moestream.load(str(path), device="cpu", progress=False)
        try:
            r = routing_report(engine, text_tokens(engine, limit=800))
        finally:
            engine.close()
    print("\n".join(report_lines(r, p.spec.n_expert_used, "tokens of the shipped English text")))
    later = [x.guess for x in r.layers if x.layer >= 2 and x.guess is not None]
    print(f"guess@K over layers 2+: {100 * sum(later) / max(1, len(later)):.1f}%")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), **{k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])})
