"""Device diagnostics: bf16 vs f32 on tiny models per layer, and a torch.profiler table of an all-resident
Qwen3-30B-A3B-shaped layer stack (the compute floor's ingredients)."""

from __future__ import annotations

import sys

import torch

import moestream
from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model


def per_layer(path: str, dtype: str) -> None:
    tokens = torch.randint(0, 1280, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    engines = [
        moestream.load(path, device="cpu", progress=False),
        moestream.load(path, device="cuda", dtype=dtype, progress=False),
    ]
    hs = []
    for e in engines:
        cache = e.new_cache()
        x = e.model.embed(torch.tensor(tokens, device=e.device))
        b = e.model.make_batch(0, len(tokens), e.device, e.dtype)
        out = [x.float().cpu()]
        p = e.experts.begin([])
        for il in range(e.spec.n_layer):
            x = e.model.layer(il, x, b, cache, p)
            out.append(x.float().cpu())
        p.end()
        out.append(e.model.head(x).float().cpu())
        hs.append(out)
    errs = [float((a - b).abs().max() / a.abs().max()) for a, b in zip(*hs, strict=True)]
    print(f"{path} {dtype}: rel err embed, layers..., logits = " + " ".join(f"{x:.1e}" for x in errs))


def profile(path: str, n_tokens: int) -> None:
    e = moestream.load(path, device="cuda", ubatch=2048, n_ctx=n_tokens + 1, progress=False)
    tokens = torch.randint(0, e.spec.n_vocab, (n_tokens,)).tolist()
    e.forward(tokens, e.new_cache())
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        e.forward(tokens, e.new_cache())
        torch.cuda.synchronize()
    print(f"--- {path} pp{n_tokens}, all resident")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    e.close()


if __name__ == "__main__":
    out = sys.argv[1]
    for q in ("F32", "Q4_K_M"):
        p = f"{out}/tiny-{q}.gguf"
        make_model(p, get_preset("tiny"), quant=q, seed=1, progress=False)
        for dt in ("float32", "bfloat16"):
            per_layer(p, dt)
    big = f"{out}/q30-4.gguf"
    make_model(big, get_preset("qwen3-30b-a3b", 4), quant="Q4_K_M", progress=False)
    profile(big, 2048)
    profile(big, 8192)
