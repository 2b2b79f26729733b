"""glm4moe's GPU path (the biased router in float32, the biases added in the decode prologue's launch, the
shared expert beside the routed sum, leading dense layers, captured decode steps) against the float32 CPU run,
and streamed experts against resident ones on the GPU. bf16 is compared as tests/models/test_qwen3moe_gpu.py
explains: tokens whose routing has a near-tie are left out."""

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


@pytest.mark.parametrize("preset", ["tiny-glm4moe", "tiny-glm4moe-odd"])
@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_float32_gpu_matches_cpu(model_file, preset, quant):
    path = model_file(preset, quant)
    cpu = moestream.load(path, device="cpu", ubatch=16, progress=False)
    gpu = moestream.load(path, device="cuda", dtype="float32", ubatch=16, progress=False)
    assert rel_err(cpu.logits(TOKENS), gpu.logits(TOKENS)) < 1e-4
    cache_cpu, cache_gpu = cpu.new_cache(), gpu.new_cache()
    cpu.forward(TOKENS[:20], cache_cpu)
    gpu.forward(TOKENS[:20], cache_gpu)
    steps_cpu = torch.cat([cpu.forward([t], cache_cpu) for t in TOKENS[20:30]])
    steps_gpu = torch.cat([gpu.forward([t], cache_gpu) for t in TOKENS[20:30]]).cpu()
    assert rel_err(steps_cpu, steps_gpu) < 1e-4  # the decode steps, captured and replayed on the GPU
    assert cpu.generate(TOKENS, GREEDY).tokens == gpu.generate(TOKENS, GREEDY).tokens
    cpu.close()
    gpu.close()


class ChoiceMargins:
    """Sees the CPU engine's routing (on_route); records each token's smallest gap between its k-th and
    (k+1)-th biased router scores (what the choice ranks), relative to their spread."""

    def __init__(self, engine, n_tokens: int):
        self.engine, self.chunk = engine, 0
        self.margin = torch.full((n_tokens,), float("inf"))

    def __call__(self, il, x, ids):
        k, m = ids.shape[1], self.engine.model
        bias = m.weights[f"blk.{il}.exp_probs_b.bias"].float()
        choice = torch.sigmoid(x.float() @ m.w(il, "ffn_gate_inp").float().T) + bias
        top = choice.topk(k + 1, dim=-1).values
        rel = (top[:, k - 1] - top[:, k]) / (top[:, 0] - top[:, k]).clamp_min(1e-6)
        start = self.engine.options.model.ubatch * self.chunk
        self.margin[start : start + len(x)] = torch.minimum(self.margin[start : start + len(x)], rel)
        if il == self.engine.spec.n_layer - 1:
            self.chunk += 1


def test_bf16_gpu_matches_f32_cpu(model_file):
    path = model_file("tiny-glm4moe", "Q4_K_M")
    cpu = moestream.load(path, device="cpu", ubatch=16, progress=False)
    gpu = moestream.load(path, device="cuda", dtype="bfloat16", ubatch=16, progress=False)
    seq = TOKENS + cpu.generate(TOKENS, GREEDY).tokens
    margins = ChoiceMargins(cpu, len(seq))
    ref = cpu.forward(seq, cpu.new_cache(), all_logits=True, on_route=margins).cpu()
    got = gpu.logits(seq)
    clear = margins.margin >= 0.02
    assert clear.sum() >= 0.7 * len(seq), f"routing near-ties at tokens {(~clear).nonzero().flatten().tolist()}"
    err = float((ref[clear] - got[clear]).abs().max() / ref.abs().max())
    assert err < 2e-2, f"bf16 GPU logits differ from f32 CPU by {err:.2e} on tokens without routing near-ties"
    cpu.close()
    gpu.close()


@pytest.fixture(scope="module")
def resident(model_file):
    engine = moestream.load(model_file("tiny-glm4moe-odd", "Q4_K_M"), device="cuda", ubatch=16, progress=False)
    yield engine.logits(TOKENS), engine.generate(TOKENS[:20], GREEDY).tokens
    engine.close()


@pytest.mark.parametrize("stream", ["overlap", "layer-major"])
@pytest.mark.parametrize("n_cpu_moe", [3, "all"])
def test_streamed_experts_are_bit_identical_to_resident(model_file, resident, stream, n_cpu_moe):
    """Two dense layers lead: -ncmoe 3 streams the third block only, as llama.cpp's count of blocks does."""
    engine = moestream.load(
        model_file("tiny-glm4moe-odd", "Q4_K_M"),
        device="cuda",
        ubatch=16,
        stream_min_batch=8,
        n_cpu_moe=n_cpu_moe,
        stream=stream,
        progress=False,
    )
    assert engine.offload.placement.streamed == ([2] if n_cpu_moe == 3 else [2, 3])
    assert torch.equal(engine.logits(TOKENS), resident[0])
    engine.close()


@pytest.mark.parametrize("small_batch", ["gather", "upload"])
def test_decode_with_streamed_experts_gives_the_resident_tokens(model_file, resident, small_batch):
    """Gathered from page-locked memory (guessed a layer ahead) or uploaded, the experts go through the
    resident run's kernels."""
    engine = moestream.load(
        model_file("tiny-glm4moe-odd", "Q4_K_M"),
        device="cuda",
        n_cpu_moe="all",
        small_batch=small_batch,
        progress=False,
    )
    assert engine.generate(TOKENS[:20], GREEDY).tokens == resident[1]
    engine.close()
