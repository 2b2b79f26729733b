"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA attention with biases on q, k, v and o, no q/k norms, YaRN RoPE
and a learned sink logit per head; even layers see a sliding window of positions, odd layers all of them.
Each layer ends in a softmax top-k MoE (router with a bias) of experts with biases and a clamped SwiGLU.
Tensor names and the math are llama.cpp's reading of the file (src/models/openai-moe.cpp).

Legend: T = tokens in the micro-batch, D = hidden size, H / Hkv = query / KV heads, Dh = head dim,
E = experts, K = experts used per token, F = expert FFN size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.models import qwen3moe
from moestream.models.layers import Batch, Cache
from moestream.models.layouts.gpt_oss import EXPERT_TENSORS
from moestream.models.spec import ModelSpec
from moestream.ops.attention import bias_rope, causal_attention, masked_attention, rope_store
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import linear, linears
from moestream.ops.moe_swiglu import ClampedGlu
from moestream.ops.norm import rms_norm
from moestream.ops.rope import rope_cos_sin
from moestream.ops.router import route_softmax_topk

QKV = ("attn_q", "attn_k", "attn_v")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's gpt-oss constants: it reads none from the file


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's state besides the KV cache: none (attention only)."""
    return 0


class Model(qwen3moe.Model):
    """qwen3moe's layer order, embedding and head with gpt-oss's biases, YaRN RoPE, attention sinks, sliding windows
    and clamped-GLU experts."""

    MOE_NORM = "post_attention_norm"  # the norm in front of a layer's MoE block

    def __init__(self, spec, weights, embedding, run=None):
        super().__init__(spec, weights, embedding, run)
        # each layer's gate, up and down biases side by side [E, 2F + D] (in place of the three): a step gathers
        # its pairs' three in one launch (three small launches a layer were a share of a decode step)
        self.expert_bias = {
            il: weights.join([f"blk.{il}.{name}.bias" for name in EXPERT_TENSORS]) for il in spec.expert_layers
        }

    def b(self, il: int, name: str) -> torch.Tensor:
        return self.weights[f"blk.{il}.{name}.bias"]

    def window(self, il: int) -> int:
        """Positions layer il's queries see (0: all of them)."""
        return self.spec.extra["sliding_window"] if self.spec.extra["sliding_layers"][il] else 0

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables of the given positions (YaRN-scaled as the file says)."""
        return rope_cos_sin(positions, self.spec.rot_dim, self.spec.rope_base, dtype, self.spec.extra["yarn"])

    def guess_experts(self, il: int, x: torch.Tensor, n: int) -> torch.Tensor:
        """The n experts layer il's router would rank first for x, the residual stream before an earlier layer:
        a guess of what il will pick, to fetch its experts ahead (ids [T, n])."""
        normed = rms_norm(x, self.w(il, self.MOE_NORM), self.spec.rms_eps)
        logits = F.linear(normed, self.w(il, "ffn_gate_inp"), self.b(il, "ffn_gate_inp"))
        return torch.topk(logits, n, dim=-1).indices

    def attention(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        q, k, v = linears(x, [self.stored(il, n) for n in QKV])  # their biases are added in attend
        out = self.attend(il, q.view(T, s.n_head, s.head_dim), k, v, batch, cache)  # [T, H, Dh]
        return linear(out.reshape(T, -1), self.stored(il, "attn_output"))  # its bias: output_bias

    def output_bias(self, il: int) -> torch.Tensor:
        return self.b(il, "attn_output")

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, cache: Cache
    ) -> torch.Tensor:
        """Heads q [T, H, Dh] attend to keys and values k, v [T, Hkv * Dh] (biases, RoPE, KV cache, sinks,
        window)."""
        if batch.rows:  # tokens of different sequences: each attends within its own cache
            rows = enumerate(zip(batch.rows, cache, strict=True))
            return torch.cat([self.attend(il, q[i : i + 1], k[i : i + 1], v[i : i + 1], b, c) for i, (b, c) in rows])
        s, T = self.spec, q.shape[0]
        k, v = k.view(T, s.n_head_kv, s.head_dim), v.view(T, s.n_head_kv, s.head_dim)
        biases = tuple(self.b(il, n) for n in QKV)
        sinks, window = self.w(il, "attn_sinks"), self.window(il)
        if batch.n_keys is None:
            q, k, v = bias_rope(q, k, v, biases, (batch.cos, batch.sin))
            k_all, v_all = cache.kv.update(il, batch.pos0, k, v)
            return causal_attention(q, k_all, v_all, sinks, window)  # [T, H, Dh]
        caches = cache.kv.k[il], cache.kv.v[il]  # a static batch writes its rows at device positions
        q = rope_store(q, k, v, biases, (batch.cos, batch.sin), caches, batch.positions)
        keys = caches[0][: batch.n_keys], caches[1][: batch.n_keys]
        return masked_attention(q, *keys, batch.positions, sinks, window)

    def moe(
        self, il: int, x: torch.Tensor, experts: ExpertSource, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' sum, plus residual if given."""
        router = self.w(il, "ffn_gate_inp"), self.b(il, "ffn_gate_inp")
        weights, ids = route_softmax_topk(x, router[0], self.spec.n_expert_used, bias=router[1])
        both = self.expert_bias[il][ids.reshape(-1)]  # the experts' biases, per token-expert pair: views of one
        widths = [self.b(il, name).shape[1] for name in EXPERT_TENSORS]
        clamped = ClampedGlu(*both.split(widths, dim=1), SWIGLU_ALPHA, SWIGLU_LIMIT)
        return routed_swiglu(x, weights, experts.weights(il, x, ids), residual, clamped=clamped)
