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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moestream.models import qwen3moe
from moestream.models.layers import Batch, Cache, Weights
from moestream.models.spec import ModelSpec
from moestream.ops.attention import masked_attention, rope_store
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import linear, swiglu
from moestream.ops.norm import add_rms_norm, rms_norm
from moestream.ops.router import BiasedTopK, biased_topk, route_biased_topk

if TYPE_CHECKING:
    from moestream.options import ModelOptions

# The router's weights and correction bias, kept float32 whatever the compute dtype (llama.cpp keeps them F32):
# the choice ranks sigmoid scores plus a bias, where bf16 rounding would pick other experts.
FLOAT32 = ("ffn_gate_inp.weight", "exp_probs_b.bias")


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
