"""A gated delta-net layer's token mix (linear attention, qwen35moe's recurrent layers): the short convolution
over its qkv projection, unit q and k, the gates, the delta rule on the layer's state (`delta_rule.py`), then
RMSNorm gated by silu(z). One GPU token runs it in two kernels (`kernels/deltanet_step.py`); otherwise torch.

Shape legend (one sequence, no batch dimension):
    T   tokens in this call
    Hk / Hv  key / value heads
    Dk  key/query head dim (GGUF `ssm.state_size`)
    Dv  value head dim
    C   channels of the short convolution (the qkv projection width)
    K   convolution kernel length (GGUF `ssm.conv_kernel`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moestream.kernels import deltanet_step
from moestream.ops.delta_rule import DeltaRule, delta_rule_recurrent
from moestream.ops.norm import rms_norm


@dataclass
class DeltaNetState:
    """What one delta-net layer remembers about one sequence, cached beside the KV cache.

    conv_state [K-1, C]: the last K-1 inputs of the short convolution (zeros before the first token).
    recurrent_state [H, Dk, Dv]: the delta-rule state S, float32 (it accumulates over the whole sequence).
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @classmethod
    def zeros(
        cls,
        conv_channels: int,
        conv_kernel: int,
        n_heads: int,
        k_dim: int,
        v_dim: int,
        *,
        conv_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> DeltaNetState:
        """The state before the first token of a sequence."""
        return cls(
            conv_state=torch.zeros(conv_kernel - 1, conv_channels, dtype=conv_dtype, device=device),
            recurrent_state=torch.zeros(n_heads, k_dim, v_dim, dtype=state_dtype, device=device),
        )

    def zero_(self) -> None:
        """Back to the state before the first token, in place."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    @property
    def nbytes(self) -> int:
        return self.conv_state.nbytes + self.recurrent_state.nbytes

    def copy(self, device: torch.device | str) -> DeltaNetState:
        """A copy on device (a prompt cache's snapshot: the recurrent state cannot be rewound)."""
        return DeltaNetState(self.conv_state.to(device, copy=True), self.recurrent_state.to(device, copy=True))

    def copy_(self, other: DeltaNetState) -> None:
        """Take other's values in place (captured decode steps point at these tensors)."""
        self.conv_state.copy_(other.conv_state)
        self.recurrent_state.copy_(other.recurrent_state)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (q and k of each head, before the delta rule).

    Computed and returned in at least float32: the delta rule consumes it in float32, so rounding the unit
    vectors back to bf16 would only lose precision.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Short causal depthwise convolution followed by SiLU, continuing from `conv_state`.

    x [T, C], weight [C, K] (oldest tap first, no bias), conv_state [K-1, C] = the K-1 inputs before x.
    Returns y [T, C] in x's dtype (accumulated in at least float32) and the new conv_state [K-1, C] (the last
    K-1 inputs, in conv_state's dtype). K is tiny (4), so a sum over taps beats a conv1d's transposes.
    """
    n_tokens = x.shape[0]
    kernel = weight.shape[1]
    compute_dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    padded = torch.cat([conv_state.to(compute_dtype), x.to(compute_dtype)], dim=0)  # [K-1+T, C]
    w = weight.to(compute_dtype)
    acc = padded[0:n_tokens] * w[:, 0]
    for tap in range(1, kernel):
        acc = acc + padded[tap : tap + n_tokens] * w[:, tap]
    new_state = padded[padded.shape[0] - (kernel - 1) :].to(conv_state.dtype)
    return F.silu(acc).to(x.dtype), new_state


class Projected(NamedTuple):
    """A delta-net layer's projections of its input x [T, D]."""

    qkv: torch.Tensor  # [T, C]
    alpha: torch.Tensor  # [T, Hv], before softplus
    beta: torch.Tensor  # [T, Hv], before the sigmoid
    z: torch.Tensor  # [T, Hv * Dv], the output gate


class MixWeights(NamedTuple):
    """A delta-net layer's weights besides its projections."""

    conv_weight: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    ssm_a: torch.Tensor  # [Hv], negative
    norm: torch.Tensor  # [Dv]


def gated_delta_mix(
    projected: Projected, weights: MixWeights, state: DeltaNetState, k_heads: int, eps: float, rule: DeltaRule
) -> torch.Tensor:
    """A delta-net layer's token mix from its projections: the short convolution over qkv, unit q and k, decay
    g = softplus(alpha + dt_bias) * ssm_a and beta = sigmoid(beta), the delta rule (`rule`) on the state, then
    RMSNorm gated by silu(z). The state moves on in place (a captured decode step reads and writes the same
    memory). Returns [T, Hv * Dv] in z's dtype; kernels/deltanet_step.py is the same for one token on a GPU."""
    qkv, alpha, beta, z = projected
    conv_weight, dt_bias, ssm_a, norm = weights
    T = qkv.shape[0]
    n_heads, dk, dv = state.recurrent_state.shape
    y, conv_state = causal_conv1d(qkv.float(), conv_weight, state.conv_state)
    state.conv_state.copy_(conv_state)
    q, k, v = y.split([k_heads * dk, k_heads * dk, n_heads * dv], dim=-1)
    # value head h reads key head h % Hk: the file stores value heads tiled over the key heads
    q = l2_normalize(q.view(T, k_heads, dk), eps).repeat(1, n_heads // k_heads, 1)  # [T, Hv, Dk]
    k = l2_normalize(k.view(T, k_heads, dk), eps).repeat(1, n_heads // k_heads, 1)
    g = F.softplus(alpha.float() + dt_bias.float()) * ssm_a.float()  # log decay, <= 0
    out, recurrent_state = rule(q, k, v.view(T, n_heads, dv), g, torch.sigmoid(beta.float()), state.recurrent_state)
    state.recurrent_state.copy_(recurrent_state)
    out = rms_norm(out, norm, eps) * F.silu(z.float().view(T, n_heads, dv))
    return out.reshape(T, -1).to(z.dtype)


def gated_delta_net(
    projected: Projected, weights: MixWeights, state: DeltaNetState, k_heads: int, eps: float, prefill: DeltaRule
) -> torch.Tensor:
    """gated_delta_mix on state, moving it on in place: one token on a GPU in two kernels, one token elsewhere
    by the recurrent rule, more tokens by the prefill rule (fla's or the chunked torch form, `prefill_rule`)."""
    if deltanet_step.usable(projected.qkv, state.conv_state, state.recurrent_state):  # a GPU token: 2 kernels
        return deltanet_step.decode_step(projected, weights, state.conv_state, state.recurrent_state, k_heads, eps)
    rule = delta_rule_recurrent if projected.qkv.shape[0] == 1 else prefill  # decode | prefill
    return gated_delta_mix(projected, weights, state, k_heads, eps, rule)
