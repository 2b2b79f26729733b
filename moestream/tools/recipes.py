"""llama.cpp's quantization recipes (`llama-quantize MODEL OUT Q4_K_M`): the GGML type each tensor gets.

The facts are those of llama.cpp's src/llama-quant.cpp (the file types' default types, then
llama_tensor_get_type): a recipe has a default type; a tensor's role, layer and the model's shape bump it; a row
that is not a whole number of the type's blocks demotes it. llama.cpp visits the tensors layer by layer (by name
within a layer) and counts the attn_v-like and ffn_down tensors as it goes; some rules read those counts, so
`tensor_types` walks in the same order. Rules that depend on the architecture read `Facts.arch`, as llama.cpp's
read the model's arch (none of them concerns the architectures moestream runs yet).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import gguf

from moestream.errors import MoestreamError
from moestream.models.spec import ModelSpec

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class Recipe:
    name: str
    file_type: gguf.LlamaFileType  # what general.file_type records
    default: Q  # the type of each quantized tensor that no rule bumps

    @property
    def quantized(self) -> bool:
        """F32 and BF16 keep every tensor in the default type: llama.cpp's rules apply to block types only."""
        return self.default not in (Q.F32, Q.BF16)

    @property
    def imatrix(self) -> bool:
        """llama-quantize makes this recipe only with an importance matrix, and its rules then choose as with one."""
        return self.default in NEED_IMATRIX


# The types llama-quantize refuses to write without an importance matrix (bar token_embd and output).
NEED_IMATRIX = frozenset({Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS})

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("F32", FT.ALL_F32, Q.F32),
        Recipe("BF16", FT.MOSTLY_BF16, Q.BF16),
        Recipe("Q8_0", FT.MOSTLY_Q8_0, Q.Q8_0),
        Recipe("Q6_K", FT.MOSTLY_Q6_K, Q.Q6_K),
        Recipe("Q5_K_M", FT.MOSTLY_Q5_K_M, Q.Q5_K),
        Recipe("Q4_K_M", FT.MOSTLY_Q4_K_M, Q.Q4_K),
        Recipe("Q4_K_S", FT.MOSTLY_Q4_K_S, Q.Q4_K),
        Recipe("Q4_0", FT.MOSTLY_Q4_0, Q.Q4_0),
        Recipe("Q3_K_L", FT.MOSTLY_Q3_K_L, Q.Q3_K),
        Recipe("Q3_K_M", FT.MOSTLY_Q3_K_M, Q.Q3_K),
        Recipe("Q3_K_S", FT.MOSTLY_Q3_K_S, Q.Q3_K),
        Recipe("Q2_K", FT.MOSTLY_Q2_K, Q.Q2_K),
        Recipe("IQ4_XS", FT.MOSTLY_IQ4_XS, Q.IQ4_XS),
        Recipe("IQ4_NL", FT.MOSTLY_IQ4_NL, Q.IQ4_NL),
        Recipe("IQ3_S", FT.MOSTLY_IQ3_S, Q.IQ3_S),
        Recipe("IQ3_XXS", FT.MOSTLY_IQ3_XXS, Q.IQ3_XXS),
        Recipe("IQ2_S", FT.MOSTLY_IQ2_S, Q.IQ2_XS),  # llama.cpp's IQ2_S recipe is mostly IQ2_XS blocks
        Recipe("IQ2_XXS", FT.MOSTLY_IQ2_XXS, Q.IQ2_XXS),
        Recipe("IQ1_M", FT.MOSTLY_IQ1_M, Q.IQ1_M),
        Recipe("MXFP4_MOE", FT.MOSTLY_MXFP4_MOE, Q.MXFP4),
    )
}


def recipe(name: str) -> Recipe:
    """The recipe of a --quant name, in any case."""
    found = RECIPES.get(name.upper())
    if found is None:
        raise MoestreamError(f"--quant {name}: choose from {', '.join(RECIPES)}")
    return found


@dataclass(frozen=True)
class Facts:
    """What llama.cpp's rules read of the model besides a tensor's own name and shape."""

    arch: str
    n_layer: int  # blocks in the file, llama.cpp's n_layer_all
    n_expert: int
    n_gqa: int  # query heads per KV head (of layer 0)

    @classmethod
    def of(cls, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> Facts:
        n_layer = 1 + max(_layer(n) for n in shapes)  # every block the file holds, extra (MTP) layers too
        return cls(spec.arch, n_layer, spec.n_expert, spec.n_head // spec.n_head_kv)


class Role(Enum):
    """llama.cpp's tensor categories that our recipes' rules tell apart."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_V = "attn_v"  # attn_v, and what llama.cpp treats alike: the fused attn_qkv and MLA's attn_kv_b
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_DOWN = "ffn_down"  # routed, shared and dense
    OTHER = "other"


# Substrings in llama.cpp's order: the first that a name holds gives its role.
_ROLES = (
    ("attn_qkv.weight", Role.ATTN_V),
    ("attn_kv_b.weight", Role.ATTN_V),
    ("attn_v.weight", Role.ATTN_V),
    ("attn_k.weight", Role.ATTN_K),
    ("attn_q.weight", Role.ATTN_Q),
    ("attn_output.weight", Role.ATTN_OUTPUT),
    ("ffn_up", Role.OTHER),  # before ffn_down, as llama.cpp tests them (no rule of ours reads up or gate)
    ("ffn_gate", Role.OTHER),
    ("ffn_down", Role.FFN_DOWN),
)


def role(name: str) -> Role:
    if name == "output.weight":
        return Role.OUTPUT
    if name == "token_embd.weight":
        return Role.TOKEN_EMBD
    return next((r for part, r in _ROLES if part in name), Role.OTHER)


def converter_type(name: str, shape: tuple[int, ...]) -> Q | None:
    """F32 for what llama.cpp's converter stores so and llama-quantize then leaves alone (vectors, biases,
    norms, routers, shared-expert gates, convolutions); None for the tensors a recipe chooses for."""
    vector = all(d == 1 for d in shape[:-1])  # ggml counts a [1, n] tensor as 1-D
    if vector or not name.endswith(".weight") or any(k in name for k in ("_norm.", "ffn_gate_inp", "ssm_conv1d")):
        return Q.F32
    return None


# A type whose block does not divide a row: llama.cpp's smaller-block stand-in (else the type stays, then F16).
_DEMOTE = {
    **dict.fromkeys((Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS), Q.IQ4_NL),
    **dict.fromkeys((Q.Q2_K, Q.Q3_K, Q.TQ1_0, Q.TQ2_0), Q.Q4_0),
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}


def _block(qtype: Q) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def fit_row(qtype: Q, n_cols: int) -> Q:
    """qtype, or what llama.cpp writes instead when a row of n_cols is not a whole number of its blocks."""
    if n_cols % _block(qtype) == 0:
        return qtype
    qtype = _DEMOTE.get(qtype, qtype)
    return qtype if n_cols % _block(qtype) == 0 else Q.F16


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_LOW_IQ = ("IQ2_XXS", "IQ2_S", "IQ1_M")  # llama.cpp's 2-bit-and-below IQ recipes (with IQ2_XS, IQ2_M, IQ1_S)


@dataclass
class _Walk:
    """One pass over a model's tensors in llama.cpp's order, with its counters."""

    r: Recipe
    m: Facts
    n_attn_v: int  # attn_v-like tensors in the model
    tied: bool  # no output.weight: token_embd is the output head too
    i_attn_v: int = 0
    i_ffn_down: int = 0

    def choose(self, name: str, shape: tuple[int, ...]) -> Q:
        kind = role(name)
        if kind is Role.OUTPUT or (self.tied and kind is Role.TOKEN_EMBD):
            qtype = self._output(shape[-1])
        elif self.r.name == "MXFP4_MOE":  # expert stacks in MXFP4, the rest in Q8_0
            qtype = Q.MXFP4 if len(shape) == 3 and shape[0] > 1 else Q.Q8_0
        elif kind is Role.TOKEN_EMBD:
            qtype = self._token_embd()
        elif self.r.name in _LOW_IQ:
            qtype = self._low_iq(kind)
        else:
            qtype = self._bumped(kind, name)
        return fit_row(qtype, shape[-1])

    def _output(self, n_cols: int) -> Q:
        r = self.r
        if r.name == "MXFP4_MOE" or n_cols % _block(r.default):
            return Q.Q8_0
        if r.name in (*_LOW_IQ, "IQ3_XXS"):
            return Q.Q5_K
        return r.default if r.default == Q.Q8_0 else Q.Q6_K

    def _token_embd(self) -> Q:
        return {"IQ2_XXS": Q.Q2_K, "IQ1_M": Q.Q2_K, "IQ2_S": Q.IQ3_S, "IQ3_XXS": Q.IQ3_S}.get(
            self.r.name, self.r.default
        )

    def _low_iq(self, kind: Role) -> Q:
        r, m = self.r, self.m
        second = Q.IQ3_S if r.name == "IQ2_S" else Q.Q2_K  # the recipe's step up where few bits hurt most
        if kind is Role.ATTN_V:
            self.i_attn_v += 1
            return Q.Q4_K if m.n_gqa >= 4 or m.n_expert >= 4 else second
        if kind is Role.ATTN_K and m.n_expert == 8:
            return Q.Q4_K
        if kind is Role.FFN_DOWN:
            early = self.i_ffn_down < m.n_layer // 8  # counts tensors, not layers: a shared expert's down too
            self.i_ffn_down += 1
            return second if early else r.default
        if kind is Role.ATTN_OUTPUT:
            if m.n_expert == 8:
                return Q.Q5_K
            return {"IQ1_M": Q.IQ2_XXS, "IQ2_S": Q.IQ3_S}.get(r.name, r.default)
        return r.default

    def _bumped(self, kind: Role, name: str) -> Q:
        if kind is Role.ATTN_V:
            qtype = self._attn_v()
            self.i_attn_v += 1
            return qtype
        if kind is Role.FFN_DOWN:
            # a MoE model's layer comes from the name: llama.cpp found Mixtral's experts out of order
            il = _layer(name) if self.m.n_expert > 1 else self.i_ffn_down
            self.i_ffn_down += 1
            return self._ffn_down(il)
        if kind is Role.ATTN_K:
            if self.m.n_expert == 8:
                return Q.Q8_0
            return Q.IQ2_S if self.r.name == "IQ3_XXS" else self.r.default
        if kind is Role.ATTN_Q:
            return Q.IQ2_S if self.r.name == "IQ3_XXS" else self.r.default
        if kind is Role.ATTN_OUTPUT:
            return self._attn_output()
        return self.r.default

    def _attn_v(self) -> Q:
        r, m, i, gqa = self.r, self.m, self.i_attn_v, self.m.n_gqa >= 4
        qtype = r.default
        if r.name == "Q2_K":
            qtype = Q.Q4_K if gqa else Q.Q3_K
        elif r.name == "IQ3_XXS":
            qtype = Q.Q4_K if gqa else Q.IQ3_XXS if r.imatrix else Q.IQ3_S
        elif r.name == "IQ3_S" and gqa:
            qtype = Q.Q4_K
        elif r.name == "Q3_K_M":
            qtype = Q.Q5_K if i < 2 else Q.Q4_K
        elif r.name == "Q3_K_L":
            qtype = Q.Q5_K
        elif r.name in ("IQ4_NL", "IQ4_XS") and gqa:
            qtype = Q.Q5_K
        elif r.name in ("Q4_K_M", "Q5_K_M") and _more_bits(i, self.n_attn_v):
            qtype = Q.Q6_K
        elif r.name == "Q4_K_S" and i < 4:
            qtype = Q.Q5_K
        return Q.Q8_0 if m.n_expert == 8 else qtype  # 8 experts (Mixtral): llama.cpp spends the bytes

    def _ffn_down(self, il: int) -> Q:
        r, n = self.r, self.m.n_layer
        if r.name == "Q2_K":
            return Q.Q3_K
        if r.name == "IQ3_XXS" and not r.imatrix:
            return Q.Q4_K if il < n // 8 else Q.Q3_K
        if r.name == "Q3_K_M":
            return Q.Q5_K if il < n // 16 else Q.Q4_K
        if r.name == "Q3_K_L":
            return Q.Q5_K
        if r.name in ("Q4_K_M", "Q5_K_M"):
            return Q.Q6_K if _more_bits(il, n) else r.default
        if r.name in ("IQ4_NL", "IQ4_XS") and il < n // 8 and not r.imatrix:
            return Q.Q5_K
        if r.name == "Q4_K_S" and il < n // 8:
            return Q.Q5_K
        return r.default

    def _attn_output(self) -> Q:
        r = self.r
        if self.m.n_expert == 8:
            bumped = ("Q2_K", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ4_XS")
            return Q.Q5_K if r.name in bumped else r.default
        return {"Q2_K": Q.Q3_K, "IQ3_XXS": Q.IQ3_S, "Q3_K_M": Q.Q4_K, "Q3_K_L": Q.Q5_K}.get(r.name, r.default)


def _layer(name: str) -> int:
    """The block of a tensor name, -1 for the model's own tensors (token_embd, output...)."""
    found = re.match(r"blk\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def tensor_types(shapes: dict[str, tuple[int, ...]], r: Recipe, facts: Facts) -> dict[str, Q]:
    """The type llama-quantize gives each tensor (numpy shapes: a row is shape[-1]) of the model as llama.cpp's
    converter wrote it (BF16; F32 for the F32 recipe), in the order of `shapes`."""
    kept = {n: q for n, s in shapes.items() if (q := converter_type(n, s)) is not None}
    if not r.quantized:
        return {n: kept.get(n, r.default) for n in shapes}
    walk = _Walk(r, facts, n_attn_v=sum(role(n) is Role.ATTN_V for n in shapes), tied="output.weight" not in shapes)
    chosen = {n: kept[n] if n in kept else walk.choose(n, shapes[n]) for n in sorted(shapes, key=_llama_order)}
    return {n: chosen[n] for n in shapes}


def _llama_order(name: str) -> tuple[int, str]:
    """llama.cpp visits a model's tensors by layer, then by name."""
    return _layer(name), name
