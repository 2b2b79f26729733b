"""What a qwen3moe file holds: its metadata read into a ModelSpec and every tensor's name and shape (llama.cpp's),
with the routed MoE tensors the architectures built on it share. No torch: `info` and the loader's checks read a
file with this alone; the math is models/qwen3moe.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields

if TYPE_CHECKING:
    from moestream.models.spec import Preset

ARCH = "qwen3moe"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def read_spec(meta: dict[str, Any], n_vocab: int) -> ModelSpec:
    return ModelSpec(**common_spec_fields(meta, ARCH, n_vocab))


def metadata(p: Preset) -> dict[str, Any]:
    """The `qwen3moe.*` keys of a generated file of preset p (read back by `read_spec`)."""
    return common_metadata(p.spec) | {ARCH + ".feed_forward_length": p.n_ff or p.spec.n_ff_exp}


def tensor_shapes(spec: ModelSpec, tied_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of this architecture, numpy order, in the order llama.cpp's converter writes them."""
    D, Dh = spec.n_embd, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, D)}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        shapes |= {
            b + "attn_norm.weight": (D,),
            b + "attn_q.weight": (spec.n_head * Dh, D),
            b + "attn_k.weight": (spec.n_head_kv * Dh, D),
            b + "attn_v.weight": (spec.n_head_kv * Dh, D),
            b + "attn_output.weight": (D, spec.n_head * Dh),
            b + "attn_q_norm.weight": (Dh,),
            b + "attn_k_norm.weight": (Dh,),
            b + "ffn_norm.weight": (D,),
        }
        shapes |= moe_shapes(spec, il)
    shapes["output_norm.weight"] = (D,)
    if not tied_output:
        shapes["output.weight"] = (spec.n_vocab, D)
    return shapes


def moe_shapes(spec: ModelSpec, il: int) -> dict[str, tuple[int, ...]]:
    """The router and routed expert stacks of layer il (shared by the architectures built on this MoE)."""
    b, D, E, F_ = f"blk.{il}.", spec.n_embd, spec.n_expert, spec.n_ff_exp
    return {
        b + "ffn_gate_inp.weight": (E, D),
        b + "ffn_gate_exps.weight": (E, F_, D),
        b + "ffn_up_exps.weight": (E, F_, D),
        b + "ffn_down_exps.weight": (E, D, F_),
    }


def expert_tensor_names(il: int) -> tuple[str, str, str]:
    return tuple(f"blk.{il}.{t}.weight" for t in EXPERT_TENSORS)  # type: ignore[return-value]
