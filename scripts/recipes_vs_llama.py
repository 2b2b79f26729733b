"""Check tools/recipes.py against llama.cpp itself: `llama-quantize --dry-run` on generated BF16 models of every
architecture, in shapes that reach each rule (48 and 40 layers, 8 experts or not, n_gqa under and over 4, rows that
fit no 256-block, a tied output head, leading dense layers, a NextN block), every recipe, every tensor's type
compared. Recipes that llama.cpp makes only with an importance matrix get a stand-in one (the rules read only
that it is there).

    python scripts/recipes_vs_llama.py PATH/TO/llama-quantize [RECIPE ...]
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from moestream.formats.gguf import GGUFFile
from moestream.models.spec import Preset
from moestream.tools.presets import get_preset
from moestream.tools.recipes import RECIPES, Facts, tensor_types
from moestream.tools.synthetic import make_model

# "[  11/ 579] blk.0.ffn_down_exps.weight - [256, 256, 4, 1], type = bf16, size = ... -> ... (q4_K)"
LINE = re.compile(r"\]\s+(\S+)\s+- \[.*\], type =\s*(\w+),(.*)")


def variant(base: str, **changes) -> Preset:
    p = get_preset(base)
    name = "-".join([base, *(f"{k}{v}" for k, v in changes.items())])
    return replace(p, name=name, spec=replace(p.spec, **changes))


VARIANTS = [
    variant("tiny", n_layer=48, n_expert=4, n_head=8, n_head_kv=1),  # qwen3-30b-a3b's rules at a tiny size
    variant("tiny", n_layer=16),  # 8 experts: llama.cpp's Mixtral rules; n_gqa 2
    variant("tiny-odd"),  # rows of 160 and 96, tied output
    variant("tiny-qwen35moe", n_layer=40, n_expert=4, n_head=16, n_head_kv=2),  # qwen3.6-35b-a3b's rules
    variant("tiny-qwen35moe"),
    variant("tiny-gpt-oss", n_layer=24, n_head_kv=1),  # n_gqa 6, rows of 160: the fallbacks
    variant("tiny-glm4moe", n_layer=16),  # a leading dense layer and a NextN block (17 blocks)
    variant("tiny-glm4moe-odd"),
]


def stand_in_imatrix(path: Path) -> None:
    """llama.cpp's legacy imatrix file with one entry."""
    name = b"blk.0.attn_q.weight"
    path.write_bytes(struct.pack(f"<ii{len(name)}sii256f", 1, len(name), name, 1, 256, *[1.0] * 256))


def llama_types(quantize: str, model: Path, recipe: str, imatrix: Path | None) -> dict[str, str]:
    args = [quantize, "--dry-run", *(["--imatrix", str(imatrix)] if imatrix else []), str(model), recipe]
    run = subprocess.run(args, capture_output=True, text=True)
    types = {}
    for line in (run.stdout + run.stderr).splitlines():
        if found := LINE.search(line):
            name, now, rest = found.groups()
            new = re.search(r"\((\w+)\)\s*$", rest)  # a tensor whose type changes ends with its new type
            types[name] = (new.group(1) if new else now).upper()
    if not types:
        sys.exit(f"llama-quantize printed no tensors for {model.name} {recipe}:\n{run.stderr[-2000:]}")
    return types


def main(quantize: str, recipes: list[str]) -> int:
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        imatrix = Path(tmp) / "imatrix.dat"
        stand_in_imatrix(imatrix)
        for p in VARIANTS:
            model = Path(tmp) / f"{p.name}.gguf"
            make_model(model, p, quant="BF16", progress=False)
            with GGUFFile(model) as f:
                shapes = {n: tuple(t.shape) for n, t in f.tensors.items()}
            for name in recipes:
                r = RECIPES[name]
                theirs = llama_types(quantize, model, name, imatrix if r.imatrix else None)
                ours = {n: q.name for n, q in tensor_types(shapes, r, Facts.of(p.spec, shapes)).items()}
                wrong = {
                    n: (ours.get(n), theirs.get(n)) for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n)
                }
                print(f"{p.name:44} {name:10} {'differs' if wrong else 'same'} ({len(theirs)} tensors)")
                for n, (a, b) in sorted(wrong.items())[:10]:
                    print(f"    {n}: ours {a}, llama.cpp {b}")
                differ += bool(wrong)
    print(f"{differ} model-recipe pairs differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:] or list(RECIPES)))
