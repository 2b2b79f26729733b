"""What a glm4moe file holds: its metadata read into a ModelSpec (the router's constants, the leading dense layers,
the NextN blocks after the trunk) and every tensor's name and shape (llama.cpp's). No torch: `info` and the
loader's checks read a file with this alone; the math is models/glm4moe.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moestream.errors import MoestreamError
from moestream.models.layouts import qwen3moe
from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields, read_float, read_int, read_key

if TYPE_CHECKING:
    from moestream.models.spec import Preset

ARCH = "glm4moe"
expert_tensor_names = qwen3moe.expert_tensor_names  # the same routed expert stacks, under the same names
GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}  # expert_gating_func: llama.cpp reads none as sigmoid here
OPTIONAL = (  # a layer's tensors a file may lack: GLM-4.5 has q/k norms, GLM-4.5-Air none
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "nextn.embed_tokens.weight",
    "nextn.shared_head_head.weight",
    "nextn.shared_head_norm.weight",
)


def read_spec(meta: dict[str, Any], n_vocab: int) -> ModelSpec:
    """Common MoE fields, with the trunk block_count - nextn_predict_layers long; the router's constants and the
    dense layers' FFN size in `extra`."""
    p = ARCH + "."
    fields = common_spec_fields(meta, ARCH, n_vocab)
    n_blocks = fields["n_layer"]
    nextn = read_int(meta, p + "nextn_predict_layers", 0, lo=0, hi=n_blocks - 1)
    fields["n_layer"] = n_blocks - nextn
    n_dense = read_int(meta, p + "leading_dense_block_count", 0, lo=0)
    sections = meta.get(p + "rope.dimension_sections")
    if isinstance(sections, list) and any(sections):
        raise MoestreamError(
            f"model metadata: {p}rope.dimension_sections = {sections!r:.60} asks for multi-section RoPE (a GLM-4.5V "
            "vision file); moestream runs the text models (GLM-4.5, GLM-4.5-Air, GLM-4.6)"
        )
    if read_int(meta, p + "attention.value_length", fields["head_dim"]) != fields["head_dim"]:
        raise MoestreamError("model metadata: attention key and value head sizes differ; moestream needs them equal")
    gating = read_int(meta, p + "expert_gating_func", 2, lo=0, hi=2**31)
    if gating not in GATING:
        raise MoestreamError(f"model metadata: {p}expert_gating_func = {gating} is not softmax (1) or sigmoid (2)")
    norm = read_key(meta, p + "expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise MoestreamError(f"model metadata: {p}expert_weights_norm = {norm!r:.60} must be true or false")
    scale = read_key(meta, p + "expert_weights_scale", 0.0)  # llama.cpp reads 0 (or none) as no scaling
    scale = 1.0 if scale == 0 else read_float(meta, p + "expert_weights_scale")
    n_group = read_int(meta, p + "expert_group_count", 0, lo=0, hi=4096)
    group_used = read_int(meta, p + "expert_group_used_count", 0, lo=0, hi=4096)
    _check_groups(fields["n_expert"], fields["n_expert_used"], n_group, group_used)
    n_shared = read_int(meta, p + "expert_shared_count", lo=0)
    extra = dict(
        n_ff=read_int(meta, p + "feed_forward_length") if n_dense else 0,
        gating=GATING[gating],
        weights_norm=norm,
        weights_scale=scale,
        n_group=max(n_group, 1),
        group_used=max(group_used, 1),
    )
    return ModelSpec(
        **fields,
        n_ff_shexp=n_shared * fields["n_ff_exp"],
        n_layer_dense_lead=n_dense,
        n_layer_nextn=nextn,
        extra=extra,
    )


def _check_groups(n_expert: int, k: int, n_group: int, group_used: int) -> None:
    """Grouped top-k as llama.cpp allows it: equal groups of at least 2 (a group ranks by its best two), fewer
    groups kept than exist, and enough experts in them for k picks."""
    if n_group <= 1:
        return
    per = n_expert // n_group
    if n_expert % n_group or per < 2 or not 1 <= group_used < n_group or group_used * per < k:
        raise MoestreamError(
            f"model metadata: {n_expert} experts in {n_group} groups, {group_used} of them kept, cannot give each "
            f"token {k} experts (groups must be equal, of 2 or more, and fewer kept than exist); the file is damaged"
        )


def metadata(p: Preset) -> dict[str, Any]:
    """The `glm4moe.*` keys of a generated file of preset p (read back by `read_spec`): block_count counts the
    NextN blocks too, as llama.cpp's converter writes it."""
    s, a = p.spec, ARCH + "."
    meta = common_metadata(s) | {
        a + "block_count": s.n_layer + s.n_layer_nextn,
        a + "leading_dense_block_count": s.n_layer_dense_lead,
        a + "expert_shared_count": s.n_ff_shexp // s.n_ff_exp,
        a + "expert_gating_func": 2,
    }
    if s.n_layer_dense_lead:
        meta[a + "feed_forward_length"] = p.n_ff
    if s.n_layer_nextn:
        meta[a + "nextn_predict_layers"] = s.n_layer_nextn
    return meta | {a + key: value for key, value in p.gguf_keys.items()}


def tensor_shapes(spec: ModelSpec, tied_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of this architecture, numpy order, the NextN blocks after the trunk included
    (OPTIONAL names those a file may lack)."""
    D, Dh, V = spec.n_embd, spec.head_dim, spec.n_vocab
    q_rows, kv_rows = spec.n_head * Dh, spec.n_head_kv * Dh
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D)}
    for il in range(spec.n_layer + spec.n_layer_nextn):
        b = f"blk.{il}."
        shapes |= {
            b + "attn_norm.weight": (D,),
            b + "attn_q.weight": (q_rows, D),
            b + "attn_k.weight": (kv_rows, D),
            b + "attn_v.weight": (kv_rows, D),
            b + "attn_q.bias": (q_rows,),
            b + "attn_k.bias": (kv_rows,),
            b + "attn_v.bias": (kv_rows,),
            b + "attn_output.weight": (D, q_rows),
            b + "attn_q_norm.weight": (Dh,),
            b + "attn_k_norm.weight": (Dh,),
            b + "post_attention_norm.weight": (D,),
        }
        if il < spec.n_layer_dense_lead:
            Fd = spec.extra["n_ff"]
            shapes |= {b + "ffn_gate.weight": (Fd, D), b + "ffn_up.weight": (Fd, D), b + "ffn_down.weight": (D, Fd)}
            continue
        shapes |= qwen3moe.moe_shapes(spec, il) | {b + "exp_probs_b.bias": (spec.n_expert,)}
        if spec.n_ff_shexp:
            Fs = spec.n_ff_shexp
            shapes |= {
                b + "ffn_gate_shexp.weight": (Fs, D),
                b + "ffn_up_shexp.weight": (Fs, D),
                b + "ffn_down_shexp.weight": (D, Fs),
            }
        if il >= spec.n_layer:  # a NextN block: the layer above plus its own input and head tensors
            shapes |= {
                b + "nextn.eh_proj.weight": (D, 2 * D),
                b + "nextn.enorm.weight": (D,),
                b + "nextn.hnorm.weight": (D,),
                b + "nextn.embed_tokens.weight": (V, D),
                b + "nextn.shared_head_head.weight": (V, D),
                b + "nextn.shared_head_norm.weight": (D,),
            }
    shapes["output_norm.weight"] = (D,)
    if not tied_output:
        shapes["output.weight"] = (V, D)
    return shapes
