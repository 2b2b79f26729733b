"""bf16 on the GPU against the float32 CPU reference."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.runtime.sampling import SamplingParams


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_bf16_gpu_matches_f32_cpu(model_file, quant):
    path = model_file("tiny", quant)
    tokens = torch.randint(0, 1280, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    cpu = moestream.load(path, device="cpu", ubatch=16, progress=False)
    gpu = moestream.load(path, device="cuda", dtype="bfloat16", ubatch=16, progress=False)
    a, b = cpu.logits(tokens), gpu.logits(tokens)
    err = float((a - b).abs().max() / a.abs().max())
    assert err < 1e-2, f"bf16 GPU logits differ from f32 CPU by {err:.2e}"
    params = SamplingParams(max_tokens=32, stop_at_eos=False)
    assert cpu.generate(tokens, params).tokens == gpu.generate(tokens, params).tokens
    cpu.close()
    gpu.close()
