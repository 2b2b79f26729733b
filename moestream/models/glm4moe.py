"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6): GQA attention with biased q/k/v projections, optional per-head q/k
RMSNorm and NEOX RoPE over part of each head; a few leading layers with a dense SwiGLU FFN, then layers of
routed SwiGLU experts (sigmoid scores, an expert-score correction bias that steers the choice only) plus an
ungated shared expert. The NextN / MTP blocks a file carries after the trunk are checked and never run.
Tensor names and keys are llama.cpp's.

Legend: T = tokens in the micro-batch, D = hidden size, H / Hkv = query / KV heads, Dh = head dim,
E = routed experts, F = an expert's FFN size, Fd = the dense layers' FFN size, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moestream.errors import MoestreamError
from moestream.models import qwen3moe
from moestream.models.layers import Batch, Cache, Weights
from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields, read_float, read_int, read_key
from moestream.ops.attention import masked_attention, rope_store
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import linear, swiglu
from moestream.ops.norm import add_rms_norm, rms_norm
from moestream.ops.router import BiasedTopK, biased_topk, route_biased_topk

if TYPE_CHECKING:
    from moestream.models.spec import Preset
    from moestream.options import ModelOptions

ARCH = "glm4moe"
expert_tensor_names = qwen3moe.expert_tensor_names  # the same routed expert stacks, under the same names
GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}  # expert_gating_func: llama.cpp reads none as sigmoid here
# The router's weights and correction bias, kept float32 whatever the compute dtype (llama.cpp keeps them F32):
# the choice ranks sigmoid scores plus a bias, where bf16 rounding would pick other experts.
FLOAT32 = ("ffn_gate_inp.weight", "exp_probs_b.bias")
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


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's state besides the KV cache: none (attention only)."""
    return 0


class Model(qwen3moe.Model):
    """qwen3moe's embedding, head and attention core (NEOX RoPE over spec.rot_dim channels) with GLM's biases,
    optional q/k norms, leading dense layers and biased routing plus a shared expert."""

    MOE_NORM = "post_attention_norm"

    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        embedding: Callable[[torch.Tensor], torch.Tensor],
        run: ModelOptions | None = None,
    ):
        super().__init__(spec, weights, embedding, run)
        e = spec.extra
        self.routing = BiasedTopK(
            spec.n_expert_used, e["gating"], e["n_group"], e["group_used"], e["weights_norm"], e["weights_scale"]
        )
        # the optional tensors each layer has, looked up once (a decode step runs every layer)
        self.biases = {il: b for il in range(spec.n_layer) if (b := self._biases(il)) is not None}
        self.norms = {
            il: (self.w(il, "attn_q_norm"), self.w(il, "attn_k_norm"))
            for il in range(spec.n_layer)
            if f"blk.{il}.attn_q_norm.weight" in weights
        }

    def layer(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache, experts: ExpertSource) -> torch.Tensor:
        eps = self.spec.rms_eps
        mixed = self.attention(il, rms_norm(x, self.w(il, "attn_norm"), eps), batch, cache)
        h, normed = add_rms_norm(x, mixed, self.w(il, self.MOE_NORM), eps)
        if il < self.spec.n_layer_dense_lead:
            return h + self.ffn(il, normed, "ffn_gate", "ffn_up", "ffn_down")
        return self.moe(il, normed, experts, residual=h)

    def _biases(self, il: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer il's q, k and v biases ([H*Dh], [Hkv*Dh] twice; zeros for one the file lacks), None if none."""
        s, w = self.spec, self.weights
        names = [f"blk.{il}.attn_{x}.bias" for x in "qkv"]
        if not any(n in w for n in names):
            return None
        rows = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_head_kv * s.head_dim)
        return tuple(
            w[n] if n in w else torch.zeros(r, device=w.device, dtype=self.w(il, "attn_norm").dtype)
            for n, r in zip(names, rows, strict=True)
        )

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, cache: Cache
    ) -> torch.Tensor:
        """qwen3moe's attend of q, k and v plus their biases; a decode step of a layer without q/k norms adds
        them in the launch that turns q and k and writes the cache (rope_store)."""
        biases = self.biases.get(il)
        if biases is None or batch.rows:  # rows: qwen3moe's attend hands each sequence's row back here
            return super().attend(il, q, k, v, batch, cache)
        if batch.n_keys is not None and il not in self.norms:
            s, T = self.spec, q.shape[0]
            k, v = k.view(T, s.n_head_kv, s.head_dim), v.view(T, s.n_head_kv, s.head_dim)
            caches = cache.kv.k[il], cache.kv.v[il]
            q = rope_store(q, k, v, biases, (batch.cos, batch.sin), caches, batch.positions)
            return masked_attention(q, caches[0][: batch.n_keys], caches[1][: batch.n_keys], batch.positions)
        bq, bk, bv = biases
        return super().attend(il, q + bq.view(q.shape[1:]), k + bk, v + bv, batch, cache)

    def qk_norms(self, il: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.norms.get(il)

    def ffn(self, il: int, x: torch.Tensor, gate: str, up: str, down: str) -> torch.Tensor:
        """A SwiGLU FFN of layer il's weights by these names: a dense layer's, or the shared expert."""
        return linear(swiglu(x, self.stored(il, gate), self.stored(il, up)), self.stored(il, down))  # [T, D]

    def moe(
        self, il: int, x: torch.Tensor, experts: ExpertSource, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' sum plus the shared expert, plus residual if given (the shared expert joins the
        residual before the sum's launch, which adds it)."""
        bias = self.weights[f"blk.{il}.exp_probs_b.bias"]
        weights, ids = route_biased_topk(x, self.w(il, "ffn_gate_inp"), bias, self.routing)
        if self.spec.n_ff_shexp:
            shared = self.ffn(il, x, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
            residual = shared if residual is None else residual + shared
        return routed_swiglu(x, weights, experts.weights(il, x, ids), residual)

    def guess_experts(self, il: int, x: torch.Tensor, n: int) -> torch.Tensor:
        """The n experts layer il's router would choose first for x, the residual before an earlier layer."""
        normed = rms_norm(x, self.w(il, self.MOE_NORM), self.spec.rms_eps)
        router = self.w(il, "ffn_gate_inp")
        logits = F.linear(normed.to(router.dtype), router)
        bias = self.weights[f"blk.{il}.exp_probs_b.bias"]
        return biased_topk(logits, bias, replace(self.routing, k=n), x.dtype)[1]
