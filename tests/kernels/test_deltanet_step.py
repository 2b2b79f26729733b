"""The delta-net decode kernels against the torch form of the same token (ops.deltanet.gated_delta_mix)."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.kernels import deltanet_step
from moestream.kernels.launch import triton
from moestream.ops.delta_rule import delta_rule_recurrent
from moestream.ops.deltanet import DeltaNetState, MixWeights, Projected, gated_delta_mix

# Without a GPU, Triton's interpreter (TRITON_INTERPRET=1, triton importable) runs the kernels on CPU tensors
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gpu_or_interpreter = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED), reason="needs CUDA or Triton's interpreter"
)


@gpu_or_interpreter
@pytest.mark.parametrize(
    "k_heads,v_heads,dk,dv,kernel",
    [(16, 32, 128, 128, 4), (2, 4, 64, 64, 4), (2, 6, 32, 48, 3)],  # qwen3.6-35b, tiny-qwen35moe, odd sizes
)
def test_decode_step_matches_the_torch_token(k_heads, v_heads, dk, dv, kernel):
    gen = torch.Generator(device=DEVICE).manual_seed(3)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=DEVICE) * scale

    C = 2 * k_heads * dk + v_heads * dv
    weights = MixWeights(
        randn(C, kernel, scale=0.5), randn(v_heads), -torch.rand(v_heads, device=DEVICE) * 4, randn(dv) + 1
    )
    ref = DeltaNetState(randn(kernel - 1, C), randn(v_heads, dk, dv, scale=0.1))
    got = DeltaNetState(ref.conv_state.clone(), ref.recurrent_state.clone())
    assert INTERPRETED or deltanet_step.usable(torch.empty(1, C, device="cuda"), got.conv_state, got.recurrent_state)
    for step in range(4):  # the states carry from token to token
        qkv = randn(1, C).bfloat16()
        alpha, beta = randn(1, v_heads).bfloat16(), randn(1, v_heads, scale=2).bfloat16()
        alpha[0, 0] = 30  # softplus's linear branch
        projected = Projected(qkv, alpha, beta, randn(1, v_heads * dv).bfloat16())
        want = gated_delta_mix(projected, weights, ref, k_heads, 1e-6, delta_rule_recurrent)
        out = deltanet_step.decode_step(projected, weights, got.conv_state, got.recurrent_state, k_heads, 1e-6)
        assert out.dtype == torch.bfloat16 and out.shape == want.shape
        assert torch.equal(got.conv_state, ref.conv_state), step
        assert float((got.recurrent_state - ref.recurrent_state).abs().max()) < 1e-5, step
        err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
        assert err < 1e-2, (step, err)  # both round once to bf16 at the end: a bf16 step apart at most


@gpu
def test_float64_states_several_tokens_and_large_heads_take_the_torch_form():
    s = DeltaNetState.zeros(8, 4, 2, 4, 4, device="cuda")
    assert deltanet_step.usable(torch.empty(1, 8, device="cuda"), s.conv_state, s.recurrent_state)
    assert not deltanet_step.usable(torch.empty(2, 8, device="cuda"), s.conv_state, s.recurrent_state)
    s64 = DeltaNetState.zeros(8, 4, 2, 4, 4, state_dtype=torch.float64, device="cuda")
    assert not deltanet_step.usable(torch.empty(1, 8, device="cuda"), s64.conv_state, s64.recurrent_state)
    big = DeltaNetState.zeros(8, 4, 2, 128, 256, device="cuda")  # a head's state past one program's tile
    assert not deltanet_step.usable(torch.empty(1, 8, device="cuda"), big.conv_state, big.recurrent_state)
