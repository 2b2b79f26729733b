"""The recipes give each tensor the type llama.cpp's llama-quantize gives it.

The expected tables were written by reading llama.cpp's src/llama-quant.cpp (llama_tensor_get_type, the file
types' defaults), not from our rules; each lists only what differs from the recipe's default type. The rules
were also checked against llama-quantize --dry-run itself (scripts/recipes_vs_llama.py) on these architectures.
"""

from __future__ import annotations

import gguf
import pytest

from moestream.errors import MoestreamError
from moestream.models.registry import layout
from moestream.tools.presets import get_preset
from moestream.tools.recipes import RECIPES, Facts, fit_row, recipe, tensor_types
from moestream.tools.synthetic import preset_metadata

Q = gguf.GGMLQuantizationType

# The type of every quantized tensor no rule bumps (MXFP4_MOE: all but the expert stacks)
DEFAULT = {
    "Q8_0": Q.Q8_0,
    "Q6_K": Q.Q6_K,
    "Q5_K_M": Q.Q5_K,
    "Q4_K_M": Q.Q4_K,
    "Q4_K_S": Q.Q4_K,
    "Q4_0": Q.Q4_0,
    "Q3_K_L": Q.Q3_K,
    "Q3_K_M": Q.Q3_K,
    "Q3_K_S": Q.Q3_K,
    "Q2_K": Q.Q2_K,
    "IQ4_XS": Q.IQ4_XS,
    "IQ4_NL": Q.IQ4_NL,
    "IQ3_S": Q.IQ3_S,
    "IQ3_XXS": Q.IQ3_XXS,
    "IQ2_S": Q.IQ2_XS,
    "IQ2_XXS": Q.IQ2_XXS,
    "IQ1_M": Q.IQ1_M,
    "MXFP4_MOE": Q.Q8_0,
}

# Converter-F32 tensors, kept by every recipe (by their name within a layer, or whole)
KEPT = (
    "attn_norm",
    "post_attention_norm",
    "ffn_norm",
    "attn_q_norm",
    "attn_k_norm",
    "ffn_gate_inp",
    "ffn_gate_inp_shexp",
    "ssm_conv1d",
    "ssm_norm",
    "ssm_a",
    "ssm_dt.bias",
    "output_norm",
)


def on(layers, qtype: Q, rest: Q | None = None) -> tuple:
    """qtype in these layers, `rest` (the default when None) in the others."""
    return (frozenset(layers), qtype, rest)


def more_bits(n: int) -> frozenset[int]:
    """llama.cpp's use_more_bits layers, written out: the first and last n/8, and every third from n/8 + 2."""
    return frozenset([*range(n // 8), *range(n // 8 + 2, 7 * n // 8, 3), *range(7 * n // 8, n)])


M48, M40 = more_bits(48), more_bits(40)
assert sorted(M48) == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
assert sorted(M40) == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39]
EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# qwen3-30b-a3b: 48 layers, 128 experts, 32 query heads over 4 KV heads (n_gqa 8), its own output head
QWEN3_30B = {
    "Q8_0": {},
    "Q6_K": {},
    "Q5_K_M": {"output": Q.Q6_K, "attn_v": on(M48, Q.Q6_K), "ffn_down_exps": on(M48, Q.Q6_K)},
    "Q4_K_M": {"output": Q.Q6_K, "attn_v": on(M48, Q.Q6_K), "ffn_down_exps": on(M48, Q.Q6_K)},
    "Q4_K_S": {"output": Q.Q6_K, "attn_v": on(range(4), Q.Q5_K), "ffn_down_exps": on(range(6), Q.Q5_K)},
    "Q4_0": {"output": Q.Q6_K},
    "Q3_K_L": {"output": Q.Q6_K, "attn_v": Q.Q5_K, "attn_output": Q.Q5_K, "ffn_down_exps": Q.Q5_K},
    "Q3_K_M": {
        "output": Q.Q6_K,
        "attn_v": on(range(2), Q.Q5_K, Q.Q4_K),
        "attn_output": Q.Q4_K,
        "ffn_down_exps": on(range(3), Q.Q5_K, Q.Q4_K),
    },
    "Q3_K_S": {"output": Q.Q6_K},
    "Q2_K": {"output": Q.Q6_K, "attn_v": Q.Q4_K, "attn_output": Q.Q3_K, "ffn_down_exps": Q.Q3_K},
    "IQ4_XS": {"output": Q.Q6_K, "attn_v": Q.Q5_K, "ffn_down_exps": on(range(6), Q.Q5_K)},
    "IQ4_NL": {"output": Q.Q6_K, "attn_v": Q.Q5_K, "ffn_down_exps": on(range(6), Q.Q5_K)},
    "IQ3_S": {"output": Q.Q6_K, "attn_v": Q.Q4_K},
    # an importance matrix is given (llama-quantize requires one): ffn_down stays IQ3_XXS
    "IQ3_XXS": {
        "token_embd": Q.IQ3_S,
        "output": Q.Q5_K,
        "attn_q": Q.IQ2_S,
        "attn_k": Q.IQ2_S,
        "attn_v": Q.Q4_K,
        "attn_output": Q.IQ3_S,
    },
    "IQ2_S": {
        "token_embd": Q.IQ3_S,
        "output": Q.Q5_K,
        "attn_v": Q.Q4_K,
        "attn_output": Q.IQ3_S,
        "ffn_down_exps": on(range(6), Q.IQ3_S),
    },
    "IQ2_XXS": {"token_embd": Q.Q2_K, "output": Q.Q5_K, "attn_v": Q.Q4_K, "ffn_down_exps": on(range(6), Q.Q2_K)},
    "IQ1_M": {
        "token_embd": Q.Q2_K,
        "output": Q.Q5_K,
        "attn_v": Q.Q4_K,
        "attn_output": Q.IQ2_XXS,
        "ffn_down_exps": on(range(6), Q.Q2_K),
    },
    "MXFP4_MOE": dict.fromkeys(EXPS, Q.MXFP4),
}


def _qwen35(table: dict) -> dict:
    """qwen3.6-35b-a3b: 40 layers, 256 experts, n_gqa 8; a layer's attn_v-like tensor is attn_qkv (delta-net
    layers) or attn_v (every 4th), one a layer, so llama.cpp's attn_v count is the layer; ffn_down is also the
    shared expert's."""
    out = dict(table)
    for k in ("attn_v", "ffn_down_exps"):
        if k in table:
            out[{"attn_v": "attn_qkv", "ffn_down_exps": "ffn_down_shexp"}[k]] = table[k]
    return out


QWEN36_35B = {
    "Q8_0": {},
    "Q6_K": {},
    "Q5_K_M": _qwen35({"output": Q.Q6_K, "attn_v": on(M40, Q.Q6_K), "ffn_down_exps": on(M40, Q.Q6_K)}),
    "Q4_K_M": _qwen35({"output": Q.Q6_K, "attn_v": on(M40, Q.Q6_K), "ffn_down_exps": on(M40, Q.Q6_K)}),
    "Q4_K_S": _qwen35({"output": Q.Q6_K, "attn_v": on(range(4), Q.Q5_K), "ffn_down_exps": on(range(5), Q.Q5_K)}),
    "Q4_0": {"output": Q.Q6_K},
    "Q3_K_L": _qwen35({"output": Q.Q6_K, "attn_v": Q.Q5_K, "attn_output": Q.Q5_K, "ffn_down_exps": Q.Q5_K}),
    "Q3_K_M": _qwen35(
        {
            "output": Q.Q6_K,
            "attn_v": on(range(2), Q.Q5_K, Q.Q4_K),
            "attn_output": Q.Q4_K,
            "ffn_down_exps": on(range(2), Q.Q5_K, Q.Q4_K),
        }
    ),
    "Q3_K_S": {"output": Q.Q6_K},
    "Q2_K": _qwen35({"output": Q.Q6_K, "attn_v": Q.Q4_K, "attn_output": Q.Q3_K, "ffn_down_exps": Q.Q3_K}),
    "IQ4_XS": _qwen35({"output": Q.Q6_K, "attn_v": Q.Q5_K, "ffn_down_exps": on(range(5), Q.Q5_K)}),
    "IQ4_NL": _qwen35({"output": Q.Q6_K, "attn_v": Q.Q5_K, "ffn_down_exps": on(range(5), Q.Q5_K)}),
    "IQ3_S": _qwen35({"output": Q.Q6_K, "attn_v": Q.Q4_K}),
    "IQ3_XXS": _qwen35(
        {
            "token_embd": Q.IQ3_S,
            "output": Q.Q5_K,
            "attn_q": Q.IQ2_S,
            "attn_k": Q.IQ2_S,
            "attn_v": Q.Q4_K,
            "attn_output": Q.IQ3_S,
        }
    ),
    # the low-bit IQ recipes count ffn_down tensors, not layers: 40 / 8 = 5 of them, exps and shexp of layers 0
    # and 1, then layer 2's exps
    "IQ2_S": _qwen35({"token_embd": Q.IQ3_S, "output": Q.Q5_K, "attn_v": Q.Q4_K, "attn_output": Q.IQ3_S})
    | {"ffn_down_exps": on(range(3), Q.IQ3_S), "ffn_down_shexp": on(range(2), Q.IQ3_S)},
    "IQ2_XXS": _qwen35({"token_embd": Q.Q2_K, "output": Q.Q5_K, "attn_v": Q.Q4_K})
    | {"ffn_down_exps": on(range(3), Q.Q2_K), "ffn_down_shexp": on(range(2), Q.Q2_K)},
    "IQ1_M": _qwen35({"token_embd": Q.Q2_K, "output": Q.Q5_K, "attn_v": Q.Q4_K, "attn_output": Q.IQ2_XXS})
    | {"ffn_down_exps": on(range(3), Q.Q2_K), "ffn_down_shexp": on(range(2), Q.Q2_K)},
    "MXFP4_MOE": dict.fromkeys(EXPS, Q.MXFP4),
}

# tiny: 2 layers, 8 experts (llama.cpp's Mixtral rules), 4 query heads over 2 KV heads (n_gqa 2)
TINY = {
    "Q4_K_M": {
        "output": Q.Q6_K,
        "attn_v": Q.Q8_0,
        "attn_k": Q.Q8_0,
        "attn_output": Q.Q5_K,
        "ffn_down_exps": on([1], Q.Q6_K),
    },
    "Q2_K": {"output": Q.Q6_K, "attn_v": Q.Q8_0, "attn_k": Q.Q8_0, "attn_output": Q.Q5_K, "ffn_down_exps": Q.Q3_K},
    "Q3_K_L": {"output": Q.Q6_K, "attn_v": Q.Q8_0, "attn_k": Q.Q8_0, "ffn_down_exps": Q.Q5_K},  # no attn_output bump
    "IQ2_XXS": {"token_embd": Q.Q2_K, "output": Q.Q5_K, "attn_v": Q.Q4_K, "attn_k": Q.Q4_K, "attn_output": Q.Q5_K},
}

# tiny-odd: rows of 160 and 96 (no 256-blocks), 6 experts, n_gqa 5, token_embd is the output head too
TINY_ODD = {
    # Q4_K -> Q5_0 and Q6_K -> Q8_0 where a row is not a multiple of 256; the tied embedding takes Q8_0
    "Q4_K_M": {
        "*": Q.Q5_0,
        "token_embd": Q.Q8_0,
        "attn_v": on([2], Q.Q8_0, Q.Q5_0),
        "ffn_down_exps": on([2], Q.Q8_0, Q.Q5_0),
    },
    "IQ4_XS": {"*": Q.IQ4_NL, "token_embd": Q.Q8_0, "attn_v": Q.Q5_1},  # Q5_K -> Q5_1
    "Q2_K": {"*": Q.Q4_0, "token_embd": Q.Q8_0, "attn_v": Q.Q5_0},  # Q2_K, Q3_K -> Q4_0; attn_v's Q4_K -> Q5_0
    "MXFP4_MOE": {"*": Q.Q8_0, **dict.fromkeys(EXPS, Q.MXFP4)},
}


def key(name: str) -> tuple[int, str]:
    """blk.3.attn_v.weight -> (3, "attn_v"); output.weight -> (-1, "output")."""
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else -1
    return layer, ".".join(parts[2:] if layer >= 0 else parts).removesuffix(".weight")


def expected(shapes: dict, name: str, table: dict) -> dict[str, Q]:
    out = {}
    default = table.get("*", DEFAULT[name])
    for n in shapes:
        layer, k = key(n)
        rule = table.get(k, default)
        if k in KEPT:
            out[n] = Q.F32
        elif isinstance(rule, tuple):
            layers, qtype, rest = rule
            out[n] = qtype if layer in layers else (rest or default)
        else:
            out[n] = rule
    return out


def model(preset: str) -> tuple[dict[str, tuple[int, ...]], Facts]:
    p = get_preset(preset)
    arch = layout(p.spec.arch)
    spec = arch.read_spec(preset_metadata(p, recipe("F32")), p.spec.n_vocab)
    shapes = arch.tensor_shapes(spec, tied_output=p.tied_output)
    return shapes, Facts.of(spec, shapes)


@pytest.mark.parametrize(
    "preset,table",
    [("qwen3-30b-a3b", QWEN3_30B), ("qwen3.6-35b-a3b", QWEN36_35B), ("tiny", TINY), ("tiny-odd", TINY_ODD)],
)
def test_types_are_llama_quantizes(preset, table):
    shapes, facts = model(preset)
    for name, rules in table.items():
        got = tensor_types(shapes, RECIPES[name], facts)
        want = expected(shapes, name, rules)
        wrong = {n: f"{got[n].name}, expected {want[n].name}" for n in shapes if got[n] != want[n]}
        assert not wrong, f"{preset} {name}: {len(wrong)} tensors differ, e.g. {dict(list(wrong.items())[:6])}"


def test_every_recipe_has_a_table():
    assert set(QWEN3_30B) == set(QWEN36_35B) == set(RECIPES) - {"F32", "BF16"}


@pytest.mark.parametrize("name,qtype", [("F32", Q.F32), ("BF16", Q.BF16)])
def test_float_recipes_keep_every_weight_in_their_type(name, qtype):
    shapes, facts = model("qwen3.6-35b-a3b")
    got = tensor_types(shapes, RECIPES[name], facts)
    assert got == {n: Q.F32 if key(n)[1] in KEPT else qtype for n in shapes}


def test_rows_that_fit_no_block_fall_back_as_llama_cpp_does():
    assert fit_row(Q.Q4_K, 512) == Q.Q4_K
    assert fit_row(Q.Q6_K, 96) == Q.Q8_0
    assert fit_row(Q.IQ2_XXS, 96) == Q.IQ4_NL
    assert fit_row(Q.Q3_K, 96) == Q.Q4_0
    assert fit_row(Q.Q4_K, 100) == Q.F16  # Q5_0's 32 does not divide it either
    assert fit_row(Q.MXFP4, 48) == Q.F16  # a 32-block type has nothing smaller to fall to


def test_recipe_names_are_case_insensitive():
    assert recipe("q4_k_m") is recipe("Q4_K_M") is RECIPES["Q4_K_M"]
    assert recipe("mxfp4_moe").file_type == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    with pytest.raises(MoestreamError, match=r"--quant Q4_K_X: choose from F32, BF16, .*MXFP4_MOE"):
        recipe("Q4_K_X")
