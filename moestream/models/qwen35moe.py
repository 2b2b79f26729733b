"""qwen35moe (Qwen3.5 / Qwen3.6 MoE, e.g. Qwen3.6-35B-A3B): gated delta-net layers with, every few layers, a
full-attention layer whose output is gated per channel; each layer ends in qwen3moe's routed MoE plus a shared
expert behind a sigmoid gate. Tensor names and layouts are llama.cpp's.

Legend: T = tokens in the micro-batch, D = hidden size, H / Hkv = query / KV heads, Dh = their head dim,
Hk / Hv = delta-net key / value heads, Dk / Dv = their head dims, C = conv channels = 2*Hk*Dk + Hv*Dv.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moestream.models import qwen3moe
from moestream.models.layers import Batch, Cache, Weights
from moestream.models.layouts.qwen35moe import conv_channels
from moestream.models.spec import ModelSpec
from moestream.ops.delta_rule import DeltaRule, prefill_rule
from moestream.ops.deltanet import DeltaNetState, MixWeights, Projected, gated_delta_net
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import linear, swiglu
from moestream.ops.norm import add_rms_norm, rms_norm
from moestream.ops.rope import imrope_text_cos_sin
from moestream.ops.router import softmax_topk

if TYPE_CHECKING:
    from moestream.options import ModelOptions


def recurrent_state(spec: ModelSpec, device: torch.device | str) -> dict[int, DeltaNetState]:
    """A fresh sequence's state of each delta-net layer."""
    e = spec.extra
    shape = (conv_channels(spec), e["conv_kernel"], e["v_heads"], e["k_dim"], e["v_dim"])
    return {il: DeltaNetState.zeros(*shape, device=device) for il in range(spec.n_layer) if e["recurrent_layers"][il]}


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's recurrent state, budgeted with its KV cache (qwen3.6-35b-a3b's 30 delta-net layers: 63
    MiB): the tensors recurrent_state makes, laid out on the meta device (no memory)."""
    states = recurrent_state(spec, "meta").values()
    return sum(t.nbytes for s in states for t in (s.conv_state, s.recurrent_state))


class Model(qwen3moe.Model):
    """qwen3moe's embedding, head, attention core and routed MoE, with delta-net layers and the extra gates.

    Norm weights are used as plain multipliers: the file already stores 1 + w.
    """

    MOE_NORM = "post_attention_norm"

    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        embedding: Callable[[torch.Tensor], torch.Tensor],
        run: ModelOptions | None = None,
    ):
        super().__init__(spec, weights, embedding, run)
        # prefill's delta rule (--deltanet / $MOESTREAM_DELTANET), chosen once: a choice this device cannot run
        # fails at load, not at the first prompt
        self.prefill_rule: DeltaRule = prefill_rule(run.deltanet if run else "auto", weights.device)

    @property
    def is_recurrent(self) -> tuple[bool, ...]:
        return self.spec.extra["recurrent_layers"]

    def new_recurrent_state(self, device: torch.device) -> dict[int, DeltaNetState]:
        return recurrent_state(self.spec, device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        return imrope_text_cos_sin(positions, s.rot_dim, s.rope_base, s.extra["rope_sections"], dtype)

    def layer(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache, experts: ExpertSource) -> torch.Tensor:
        eps = self.spec.rms_eps
        mix = self.delta_net if self.is_recurrent[il] else self.attention
        mixed = mix(il, rms_norm(x, self.w(il, "attn_norm"), eps), batch, cache)
        h, normed = add_rms_norm(x, mixed, self.w(il, self.MOE_NORM), eps)
        return self.moe(il, normed, experts, residual=h)

    def attention(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache) -> torch.Tensor:
        """Full attention whose output is gated per channel by sigmoid(gate), the gate projected beside q."""
        s, T = self.spec, x.shape[0]
        q_gate, k, v = self.project(il, x, ("attn_q", "attn_k", "attn_v"))
        q, gate = q_gate.view(T, s.n_head, 2, s.head_dim).unbind(2)  # per head [q_h | gate_h]: [T, H, Dh] each
        out = self.attend(il, q, k, v, batch, cache) * torch.sigmoid(gate)
        return linear(out.reshape(T, -1), self.stored(il, "attn_output"))

    def delta_net(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache) -> torch.Tensor:
        """Gated delta-net: short conv over qkv, the delta rule on the layer's state, gated RMSNorm, ssm_out.

        The state lives in cache.recurrent[il], so any split into micro-batches gives the same result.
        """
        if batch.rows:  # tokens of different sequences: each moves its own state
            rows = zip(batch.rows, cache, strict=True)
            return torch.cat([self.delta_net(il, x[i : i + 1], b, c) for i, (b, c) in enumerate(rows)])
        eps = self.spec.rms_eps
        state: DeltaNetState = cache.recurrent[il]
        projected = Projected(*self.project(il, x, ("attn_qkv", "ssm_alpha", "ssm_beta", "attn_gate")))
        b = f"blk.{il}."
        w = MixWeights(
            self.w(il, "ssm_conv1d"), self.weights[b + "ssm_dt.bias"], self.weights[b + "ssm_a"], self.w(il, "ssm_norm")
        )
        out = gated_delta_net(projected, w, state, self.spec.extra["k_heads"], eps, self.prefill_rule)
        return linear(out, self.stored(il, "ssm_out"))

    def moe(
        self, il: int, x: torch.Tensor, experts: ExpertSource, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Routed experts plus the shared expert scaled by sigmoid(x . ffn_gate_inp_shexp), plus residual if
        given (added last: the shared expert comes between the routed sum and it). A decode step on a GPU
        takes the router's and the shared gate's products in one launch, the shared gate and up in one, and
        adds the shared expert and the residual inside the routed sum's launch."""
        logits, gate = self.project(il, x, ("ffn_gate_inp", "ffn_gate_inp_shexp"))  # [T, E], [T, 1]
        weights, ids = softmax_topk(logits, self.spec.n_expert_used, x.dtype)
        h = swiglu(x, self.stored(il, "ffn_gate_shexp"), self.stored(il, "ffn_up_shexp"))  # the shared expert
        shared = linear(h, self.stored(il, "ffn_down_shexp"))
        return routed_swiglu(x, weights, experts.weights(il, x, ids), residual, (shared, gate))
