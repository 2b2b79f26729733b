"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with per-head q/k RMSNorm and NEOX RoPE,
then a softmax top-k MoE of SwiGLU experts. Tensor names are llama.cpp's.

Legend: T = tokens in the micro-batch, D = hidden size, H / Hkv = query / KV heads, Dh = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moestream.models.layers import Batch, Cache, Weights
from moestream.models.spec import ModelSpec
from moestream.ops.attention import causal_attention, masked_attention, norm_rope_store
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import Weight, head_logits, linear, linears
from moestream.ops.norm import add_rms_norm, rms_norm
from moestream.ops.rope import rms_norm_rope, rope_cos_sin
from moestream.ops.router import route_softmax_topk

if TYPE_CHECKING:
    from moestream.options import ModelOptions


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's state besides the KV cache: none (attention only)."""
    return 0


class Model:
    """The forward pass, one layer at a time so the engine can order micro-batches and layers as it likes."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        embedding: Callable[[torch.Tensor], torch.Tensor],
        run: ModelOptions | None = None,  # how it computes; qwen3moe's math needs none of it
    ):
        self.spec = spec
        self.weights = weights  # dense tensors on the compute device; "output.weight" even when tied
        self.embedding = embedding  # token ids -> rows [T, D] on the compute device
        self.attention_layers = spec.attention_layers

    def new_recurrent_state(self, device: torch.device) -> dict:
        return {}  # attention only: the KV cache holds everything

    def w(self, il: int, name: str) -> torch.Tensor:
        return self.weights[f"blk.{il}.{name}.weight"]

    def stored(self, il: int, name: str) -> Weight:
        """Layer il's weight `name` as the ops multiply it: quantized blocks stay stored (not dequantized)."""
        return self.weights.stored(f"blk.{il}.{name}.weight")

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables of the given positions."""
        return rope_cos_sin(positions, self.spec.rot_dim, self.spec.rope_base, dtype)

    def make_batch(self, pos0: int, n_tokens: int, device: torch.device, dtype: torch.dtype) -> Batch:
        positions = torch.arange(pos0, pos0 + n_tokens, device=device)
        return Batch(pos0, *self.rope(positions, dtype), positions)

    def static_batch(self, positions: torch.Tensor, n_keys: int, dtype: torch.dtype) -> Batch:
        """A batch at device positions that attends over n_keys cache rows: the same work every step."""
        return Batch(-1, *self.rope(positions, dtype), positions, n_keys)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)  # [T, D]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.weights["output_norm.weight"], self.spec.rms_eps)
        return head_logits(x, self.weights.stored("output.weight"))  # [T, n_vocab]

    MOE_NORM = "ffn_norm"  # the norm in front of a layer's MoE block

    def layer(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache, experts: ExpertSource) -> torch.Tensor:
        """experts: the pass's source of routed experts (the engine's, like the cache)."""
        eps = self.spec.rms_eps
        mixed = self.attention(il, rms_norm(x, self.w(il, "attn_norm"), eps), batch, cache)
        h, normed = add_rms_norm(x, mixed, self.w(il, self.MOE_NORM), eps, self.output_bias(il))
        return self.moe(il, normed, experts, residual=h)

    def output_bias(self, il: int) -> torch.Tensor | None:
        """The attention output projection's bias, added with the residual (attention returns without it)."""
        return None

    def guess_experts(self, il: int, x: torch.Tensor, n: int) -> torch.Tensor:
        """The n experts layer il's router would rank first for x, the residual stream before an earlier layer:
        a guess of what il will pick, to fetch its experts ahead (ids [T, n])."""
        logits = F.linear(rms_norm(x, self.w(il, self.MOE_NORM), self.spec.rms_eps), self.w(il, "ffn_gate_inp"))
        return torch.topk(logits, n, dim=-1).indices

    def attention(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        q, k, v = self.project(il, x, ("attn_q", "attn_k", "attn_v"))
        out = self.attend(il, q.view(T, s.n_head, s.head_dim), k, v, batch, cache)  # [T, H, Dh]
        return linear(out.reshape(T, -1), self.stored(il, "attn_output"))

    def project(self, il: int, x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
        """x times several of layer il's weights; for a decode step one launch for all of them."""
        return linears(x, [self.stored(il, name) for name in names])

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, cache: Cache
    ) -> torch.Tensor:
        """Heads q [T, H, Dh] attend to keys and values k, v [T, Hkv * Dh] (q/k norm, RoPE, KV cache)."""
        if batch.rows:  # tokens of different sequences: each attends within its own cache
            rows = enumerate(zip(batch.rows, cache, strict=True))
            return torch.cat([self.attend(il, q[i : i + 1], k[i : i + 1], v[i : i + 1], b, c) for i, (b, c) in rows])
        s, T = self.spec, q.shape[0]
        k, v = k.view(T, s.n_head_kv, s.head_dim), v.view(T, s.n_head_kv, s.head_dim)
        norms = self.qk_norms(il)
        if batch.n_keys is None:
            q_norm, k_norm = norms or (None, None)
            q = rms_norm_rope(q, q_norm, s.rms_eps, batch.cos, batch.sin)
            k = rms_norm_rope(k, k_norm, s.rms_eps, batch.cos, batch.sin)
            k_all, v_all = cache.kv.update(il, batch.pos0, k, v)
            return causal_attention(q, k_all, v_all)  # [T, H, Dh]
        caches = cache.kv.k[il], cache.kv.v[il]  # a static batch writes its rows at device positions
        q = norm_rope_store(q, k, v, norms, s.rms_eps, (batch.cos, batch.sin), caches, batch.positions)
        return masked_attention(q, caches[0][: batch.n_keys], caches[1][: batch.n_keys], batch.positions)

    def qk_norms(self, il: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer il's per-head RMSNorm weights of q and k, taken before RoPE (None: the layer has none)."""
        return self.w(il, "attn_q_norm"), self.w(il, "attn_k_norm")

    def moe(
        self, il: int, x: torch.Tensor, experts: ExpertSource, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' sum, plus residual if given (in the sum's launch on a GPU)."""
        weights, ids = route_softmax_topk(x, self.w(il, "ffn_gate_inp"), self.spec.n_expert_used)
        return routed_swiglu(x, weights, experts.weights(il, x, ids), residual)
