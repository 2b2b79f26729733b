"""The GPU path against the float32 CPU reference: float32 on the GPU agrees to rounding; bf16 within 1e-2.

A random-weight model has near-ties that bf16 rounding may legitimately flip: a token whose k-th and
(k+1)-th router probabilities are within 2% at some layer can switch experts, and then its logits differ
by far more than rounding (seen on the H200: one such token at 6.6e-2, every other token below 6e-3). The
bf16 logits comparison skips those tokens. The greedy comparison runs along the float32 reference's own
32 greedy tokens (teacher-forced, so one legitimate flip does not derail every later step) and checks every
step whose reference top-two logits are more than 2% apart and whose routing has no near-tie; both checks
must cover most of the sequence.
"""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
TOKENS = torch.randint(0, 1280, (50,), generator=torch.Generator().manual_seed(2)).tolist()
GREEDY = SamplingParams(max_tokens=32, stop_at_eos=False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


class RouterMargins:
    """Sees the CPU engine's routing (on_route); records each token's smallest top-k boundary margin."""

    def __init__(self, engine, n_tokens: int):
        self.engine, self.chunk = engine, 0
        self.margin = torch.full((n_tokens,), float("inf"))

    def __call__(self, il, x, ids):
        k = ids.shape[1]
        probs = torch.softmax(x.float() @ self.engine.model.w(il, "ffn_gate_inp").float().T, dim=-1)
        top = probs.topk(k + 1, dim=-1).values
        start = self.engine.options.model.ubatch * self.chunk
        rel = (top[:, k - 1] - top[:, k]) / top[:, k - 1]
        self.margin[start : start + len(x)] = torch.minimum(self.margin[start : start + len(x)], rel)
        if il == self.engine.spec.n_layer - 1:
            self.chunk += 1


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_float32_gpu_matches_cpu(model_file, quant):
    path = model_file("tiny", quant)
    cpu = moestream.load(path, device="cpu", ubatch=16, progress=False)
    gpu = moestream.load(path, device="cuda", dtype="float32", ubatch=16, progress=False)
    assert rel_err(cpu.logits(TOKENS), gpu.logits(TOKENS)) < 1e-4
    assert cpu.generate(TOKENS, GREEDY).tokens == gpu.generate(TOKENS, GREEDY).tokens
    cpu.close()
    gpu.close()


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_bf16_gpu_matches_f32_cpu(model_file, quant):
    path = model_file("tiny", quant)
    cpu = moestream.load(path, device="cpu", ubatch=16, progress=False)
    gpu = moestream.load(path, device="cuda", dtype="bfloat16", ubatch=16, progress=False)
    seq = TOKENS + cpu.generate(TOKENS, GREEDY).tokens  # the prompt and the reference's greedy continuation
    margins = RouterMargins(cpu, len(seq))
    ref = cpu.forward(seq, cpu.new_cache(), all_logits=True, on_route=margins).cpu()
    got = gpu.logits(seq)
    clear = margins.margin >= 0.02
    ties = (~clear).nonzero().flatten().tolist()
    assert clear.sum() >= 0.8 * len(seq), f"routing near-ties at tokens {ties}"
    err = float((ref[clear] - got[clear]).abs().max() / ref.abs().max())
    assert err < 1e-2, f"bf16 GPU logits differ from f32 CPU by {err:.2e} on tokens without routing near-ties"
    steps = slice(len(TOKENS) - 1, len(seq) - 1)  # the positions that predict each greedy token
    top2 = ref[steps].topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1] >= 0.02 * top2[:, 0].abs()) & clear[steps]
    assert decided.sum() >= 16, f"only {int(decided.sum())} of 32 greedy steps are free of near-ties"
    want, chose = ref[steps].argmax(-1), got[steps].argmax(-1)
    bad = (decided & (want != chose)).nonzero().flatten().tolist()
    assert not bad, f"bf16 greedy differs at steps {bad}"
    cpu.close()
    gpu.close()
