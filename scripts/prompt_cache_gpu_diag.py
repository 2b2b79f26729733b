"""Where gpt-oss' follow-up answers differ from cold ones on a GPU (tests/runtime/test_prompt_cache_gpu.py): the
scheduler without the prompt cache, with it, and both with captured steps off, each against engine.generate.

    PYTHONPATH=.:tests/runtime python scripts/prompt_cache_gpu_diag.py [PRESET]      (on the GPU machine)
"""

from __future__ import annotations

import os
import sys

from test_prompt_cache import GREEDY, UB, ask, serving

import moestream
from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model

PRESET = sys.argv[1] if len(sys.argv) > 1 else "tiny-gpt-oss"
PATH = f"/tmp/{PRESET}-diag.gguf"
FIRST = list(range(50, 69))
FOLLOW = FIRST + [3, 4, 5, 6, 7, 8]


def run(graphs: bool, n_cpu_moe) -> None:
    engine = moestream.load(
        PATH, device=os.environ.get("DEVICE", "cuda"), progress=False, ubatch=UB, n_ctx=256, n_cpu_moe=n_cpu_moe
    )
    engine.step.capturing.one = engine.step.capturing.batch = graphs
    want = {tuple(p): engine.generate(p, GREEDY).text for p in (FIRST, FOLLOW)}
    again = engine.generate(FOLLOW, GREEDY).text
    with serving(engine, max_seqs=2) as s:
        got = [(ask(s, p, cache_prompt=c).text, p is FOLLOW, c) for c in (False, True) for p in (FIRST, FOLLOW)]
    for text, follow, cached in got:
        ok = text == want[tuple(FOLLOW if follow else FIRST)]
        print(
            f"graphs {graphs} ncmoe {n_cpu_moe} {'follow' if follow else 'first '} cache_prompt {cached}: "
            f"{'same' if ok else 'DIFFERS'} {text!r} vs generate {want[tuple(FOLLOW if follow else FIRST)]!r}"
        )
    print(f"  generate(follow) twice equal: {again == want[tuple(FOLLOW)]}")


if __name__ == "__main__":
    make_model(PATH, get_preset(PRESET, None), quant="Q4_K_M", seed=1, progress=False)
    for graphs in (True, False):
        for n_cpu_moe in (0, "all"):
            run(graphs, n_cpu_moe)
