"""What a gpt-oss file holds: its metadata read into a ModelSpec (the sliding window, which layers slide, the RoPE
scaling) and every tensor's name and shape (llama.cpp's). No torch: `info` and the loader's checks read a file
with this alone; the math is models/gpt_oss.py."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from moestream.errors import MoestreamError
from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields, read_float, read_int, read_key
from moestream.ops.yarn import YaRN

if TYPE_CHECKING:
    from moestream.models.spec import Preset

ARCH = "gpt-oss"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SWA_PATTERN = 2  # llama.cpp's default for gpt-oss: of each 2 layers, the first slides


def read_spec(meta: dict[str, Any], n_vocab: int) -> ModelSpec:
    """Common MoE fields plus, in `extra`, the sliding window, which layers slide, and the RoPE scaling."""
    p = ARCH + "."
    fields = common_spec_fields(meta, ARCH, n_vocab)
    n_layer = fields["n_layer"]
    if read_int(meta, p + "attention.value_length", fields["head_dim"]) != fields["head_dim"]:
        raise MoestreamError("model metadata: attention key and value head sizes differ; moestream needs them equal")
    if read_float(meta, p + "rope.freq_base_swa", fields["rope_base"]) != fields["rope_base"]:
        raise MoestreamError(
            f"model metadata: {p}rope.freq_base_swa differs from {p}rope.freq_base; moestream turns both kinds "
            "of layer by one RoPE base"
        )
    pattern = read_key(meta, p + "attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, list):  # an explicit flag per layer
        if len(pattern) != n_layer or not all(isinstance(s, bool | int) for s in pattern):
            raise MoestreamError(f"model metadata: {p}attention.sliding_window_pattern must be {n_layer} flags")
        sliding = tuple(bool(s) for s in pattern)
    else:
        n = read_int(meta, p + "attention.sliding_window_pattern", SWA_PATTERN, lo=0)
        sliding = tuple(n == 0 or il % n < n - 1 for il in range(n_layer))
    extra = dict(
        sliding_window=read_int(meta, p + "attention.sliding_window", hi=1 << 24),
        sliding_layers=sliding,
        yarn=read_rope_scaling(meta, fields["n_ctx_train"]),
    )
    return ModelSpec(**fields, extra=extra)


def read_rope_scaling(meta: dict[str, Any], n_ctx_train: int) -> YaRN | None:
    """The file's `rope.scaling.*` keys as llama.cpp applies them: type (linear unless given), factor,
    original context and attention factor; its YaRN betas, extrapolation and attention factors are the
    defaults (32, 1, 1 and 1 + 0.1 ln factor), whatever keys the file carries. None: plain RoPE."""
    p = ARCH + ".rope.scaling."
    kind = read_key(meta, p + "type", "linear")
    if kind not in ("none", "linear", "yarn"):
        raise MoestreamError(f"model metadata: {p}type = {kind!r:.40}; moestream supports none, linear and yarn")
    factor = read_float(meta, p + "factor", 1.0) if kind != "none" else 1.0
    attn_factor = read_float(meta, p + "attn_factor", 1.0)
    if kind == "yarn":
        mscale = attn_factor * (1 + 0.1 * math.log(factor) if factor > 1 else 1.0)
        n_ctx_orig = read_int(meta, p + "original_context_length", n_ctx_train, hi=1 << 24)
        return YaRN(factor, n_ctx_orig, mscale=mscale)
    if factor == 1.0 and attn_factor == 1.0:
        return None
    return YaRN(factor, n_ctx_train, ext_factor=0.0, mscale=attn_factor)  # linear: every pair interpolated


def metadata(p: Preset) -> dict[str, Any]:
    """The `gpt-oss.*` keys of a generated file of preset p (read back by `read_spec`)."""
    a = ARCH + "."
    return (
        common_metadata(p.spec)
        | {a + "feed_forward_length": p.n_ff or p.spec.n_ff_exp}
        | {a + key: value for key, value in p.gguf_keys.items()}
    )


def tensor_shapes(spec: ModelSpec, tied_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of this architecture, numpy order. llama.cpp requires the output head (a file
    without it is refused), so tied_output changes nothing here."""
    D, Dh, H, Hkv = spec.n_embd, spec.head_dim, spec.n_head, spec.n_head_kv
    E, F_ = spec.n_expert, spec.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, D)}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        shapes |= {
            b + "attn_norm.weight": (D,),
            b + "attn_q.weight": (H * Dh, D),
            b + "attn_q.bias": (H * Dh,),
            b + "attn_k.weight": (Hkv * Dh, D),
            b + "attn_k.bias": (Hkv * Dh,),
            b + "attn_v.weight": (Hkv * Dh, D),
            b + "attn_v.bias": (Hkv * Dh,),
            b + "attn_output.weight": (D, H * Dh),
            b + "attn_output.bias": (D,),
            b + "attn_sinks.weight": (H,),
            b + "post_attention_norm.weight": (D,),
            b + "ffn_gate_inp.weight": (E, D),
            b + "ffn_gate_inp.bias": (E,),
            b + "ffn_gate_exps.weight": (E, F_, D),
            b + "ffn_gate_exps.bias": (E, F_),
            b + "ffn_up_exps.weight": (E, F_, D),
            b + "ffn_up_exps.bias": (E, F_),
            b + "ffn_down_exps.weight": (E, D, F_),
            b + "ffn_down_exps.bias": (E, D),
        }
    shapes["output_norm.weight"] = (D,)
    shapes["output.weight"] = (spec.n_vocab, D)
    return shapes


def expert_tensor_names(il: int) -> tuple[str, str, str]:
    """The routed expert stacks (their biases are dense: small, and read by the router's ids)."""
    return tuple(f"blk.{il}.{t}.weight" for t in EXPERT_TENSORS)  # type: ignore[return-value]
