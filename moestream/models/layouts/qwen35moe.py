"""What a qwen35moe file holds: its metadata read into a ModelSpec (the delta-net shapes, the RoPE sections, which
layers recur) and every tensor's name and shape (llama.cpp's). No torch: `info` and the loader's checks read a
file with this alone; the math is models/qwen35moe.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moestream.errors import MoestreamError
from moestream.models.layouts import qwen3moe
from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields, read_int, read_key

if TYPE_CHECKING:
    from moestream.models.spec import Preset

ARCH = "qwen35moe"
expert_tensor_names = qwen3moe.expert_tensor_names  # the same routed expert stacks, under the same names


def read_spec(meta: dict[str, Any], n_vocab: int) -> ModelSpec:
    """Common MoE fields plus, in `extra`, the delta-net shapes, the RoPE sections and which layers recur."""
    p = ARCH + "."
    fields = common_spec_fields(meta, ARCH, n_vocab)
    n_layer, head_dim = fields["n_layer"], fields["head_dim"]
    k_heads = read_int(meta, p + "ssm.group_count")
    v_heads = read_int(meta, p + "ssm.time_step_rank")
    inner = read_int(meta, p + "ssm.inner_size")
    sections = read_key(meta, p + "rope.dimension_sections")
    if k_heads <= 0 or v_heads <= 0 or v_heads % k_heads or inner % v_heads:
        raise MoestreamError(
            f"model metadata: {v_heads} delta-net value heads of {inner} channels in all "
            f"do not tile over {k_heads} key heads"
        )
    if not isinstance(sections, list) or len(sections) != 4 or not all(type(x) is int and x >= 0 for x in sections):
        raise MoestreamError(f"model metadata: {p}rope.dimension_sections = {sections!r:.60} must be 4 counts")
    if read_int(meta, p + "attention.value_length", head_dim) != head_dim:
        raise MoestreamError("model metadata: attention key and value head sizes differ; moestream needs them equal")
    if p + "attention.recurrent_layers" in meta:  # an explicit pattern wins over the interval
        recurrent = meta[p + "attention.recurrent_layers"]
        if not isinstance(recurrent, list) or not all(isinstance(r, bool | int) for r in recurrent):
            raise MoestreamError(f"model metadata: {p}attention.recurrent_layers must be a list of booleans")
        recurrent = [bool(r) for r in recurrent]
    else:
        interval = read_int(meta, p + "full_attention_interval", 4, lo=0)
        if interval <= 0:
            raise MoestreamError(f"model metadata: {p}full_attention_interval = {interval} must be positive")
        recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
    if len(recurrent) != n_layer:
        raise MoestreamError(
            f"model metadata: {p}attention.recurrent_layers has {len(recurrent)} entries for {n_layer} layers"
        )
    extra = dict(
        conv_kernel=read_int(meta, p + "ssm.conv_kernel", hi=64),
        k_heads=k_heads,
        v_heads=v_heads,
        k_dim=read_int(meta, p + "ssm.state_size"),
        v_dim=inner // v_heads,
        rope_sections=tuple(sections),
        recurrent_layers=tuple(recurrent),
    )
    n_ff_shexp = read_int(meta, p + "expert_shared_feed_forward_length")
    return ModelSpec(**fields, n_ff_shexp=n_ff_shexp, extra=extra)


def metadata(p: Preset) -> dict[str, Any]:
    """The `qwen35moe.*` keys of a generated file of preset p (read back by `read_spec`)."""
    a = ARCH + "."
    return (
        common_metadata(p.spec)
        | {a + "expert_shared_feed_forward_length": p.spec.n_ff_shexp}
        | {a + key: value for key, value in p.gguf_keys.items()}
    )


def conv_channels(spec: ModelSpec) -> int:
    """Width of the qkv projection, which the short convolution runs over."""
    e = spec.extra
    return 2 * e["k_heads"] * e["k_dim"] + e["v_heads"] * e["v_dim"]


def tensor_shapes(spec: ModelSpec, tied_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of this architecture, numpy order."""
    e, D, Dh = spec.extra, spec.n_embd, spec.head_dim
    value_width, Hv = e["v_heads"] * e["v_dim"], e["v_heads"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, D)}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        shapes[b + "attn_norm.weight"] = (D,)
        if e["recurrent_layers"][il]:
            shapes |= {
                b + "attn_qkv.weight": (conv_channels(spec), D),
                b + "attn_gate.weight": (value_width, D),
                b + "ssm_conv1d.weight": (conv_channels(spec), e["conv_kernel"]),
                b + "ssm_dt.bias": (Hv,),
                b + "ssm_a": (Hv,),
                b + "ssm_alpha.weight": (Hv, D),
                b + "ssm_beta.weight": (Hv, D),
                b + "ssm_norm.weight": (e["v_dim"],),
                b + "ssm_out.weight": (D, value_width),
            }
        else:
            shapes |= {
                b + "attn_q.weight": (2 * spec.n_head * Dh, D),  # per head [q_h | gate_h]
                b + "attn_k.weight": (spec.n_head_kv * Dh, D),
                b + "attn_v.weight": (spec.n_head_kv * Dh, D),
                b + "attn_output.weight": (D, spec.n_head * Dh),
                b + "attn_q_norm.weight": (Dh,),
                b + "attn_k_norm.weight": (Dh,),
            }
        shapes[b + "post_attention_norm.weight"] = (D,)
        shapes |= qwen3moe.moe_shapes(spec, il)
        shapes |= {
            b + "ffn_gate_inp_shexp.weight": (1, D),  # ggml {D, 1}; llama.cpp also accepts {D}
            b + "ffn_gate_shexp.weight": (spec.n_ff_shexp, D),
            b + "ffn_up_shexp.weight": (spec.n_ff_shexp, D),
            b + "ffn_down_shexp.weight": (D, spec.n_ff_shexp),
        }
    shapes["output_norm.weight"] = (D,)
    if not tied_output:
        shapes["output.weight"] = (spec.n_vocab, D)
    return shapes
