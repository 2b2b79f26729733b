"""Which CUDA piece makes a q8_0 KV cache's prompt logits differ from the CPU device's (tests/runtime/
test_kv_types_gpu.py fails on CUDA, passes under Triton's interpreter): the engine as is, with the torch row
quantizer instead of the Triton one, without the decode attention kernel, and without both.

    PYTHONPATH=.:tests/runtime python scripts/kv_gpu_diag.py        (on the GPU machine)
"""

from __future__ import annotations

import torch
from test_kv_types import PROMPT

import moestream
from moestream.kernels import decode_attention, kv_quant
from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model

PATH = "/tmp/kv-tiny.gguf"


def logits(device: str, kv: str, ubatch: int = 8) -> torch.Tensor:
    e = moestream.load(
        PATH, device=device, progress=False, cache_type_k=kv, cache_type_v=kv, ubatch=ubatch, dtype="float32"
    )
    try:
        return e.forward(PROMPT, e.new_cache(), all_logits=True).float().cpu()
    finally:
        e.close()


def error(got: torch.Tensor, want: torch.Tensor) -> str:
    rows = (got - want).abs().amax(-1) / want.abs().amax(-1)
    return f"max {rows.max():.2e}, rows 0-3 {[round(x, 4) for x in rows[:4].tolist()]}"


if __name__ == "__main__":
    make_model(PATH, get_preset("tiny", None), quant="Q8_0", seed=1, progress=False)
    for kv in ("q8_0", "f16"):
        print(kv, "as is:", error(logits("cuda", kv), logits("cpu", kv)))
        print(kv, "ubatch 64:", error(logits("cuda", kv, 64), logits("cpu", kv, 64)))
    want = logits("cpu", "q8_0")
    triton_quantize, kernel_usable = kv_quant.quantize, decode_attention.usable
    kv_quant.quantize = kv_quant.quantize_torch
    print("q8_0, torch quantizer:", error(logits("cuda", "q8_0"), want))
    kv_quant.quantize = triton_quantize
    decode_attention.usable = lambda q: False
    print("q8_0, no decode kernel:", error(logits("cuda", "q8_0"), want))
    kv_quant.quantize = kv_quant.quantize_torch
    print("q8_0, neither:", error(logits("cuda", "q8_0"), want))
    # every row quantization inside the engine, both forms on the same input: where they differ, and whether a
    # fresh copy of the input after a device sync quantizes right (a race) or not (the kernel)
    kv_quant.quantize = triton_quantize
    calls = []

    def both(x: torch.Tensor, name: str) -> torch.Tensor:
        x2 = x.reshape(x.shape[0], -1)
        got, want = kv_quant.quantize_kernel(x2, name), kv_quant.quantize_torch(x2, name)
        torch.cuda.synchronize()
        again = kv_quant.quantize_kernel(x2.clone(), name)
        bad = (got != want).sum().item()
        if bad or len(calls) < 3:
            calls.append(
                f"{tuple(x.shape)} {x.dtype} stride {x.stride()} ptr%16 {x.data_ptr() % 16} "
                f"contig {x.is_contiguous()} stream {torch.cuda.current_stream().cuda_stream}: {bad} bytes differ, "
                f"after sync on a copy {(again != want).sum().item()}"
            )
        return want

    kv_quant.quantize = both
    decode_attention.usable = kernel_usable
    print("q8_0, both quantizers compared:", error(logits("cuda", "q8_0"), want))
    print("\n".join(calls[:12]))
