"""Decode attention deep in a context, per kernel setting: one token's attention over every layer's cache as the
decode step runs it (a cache of n_ctx = depth + 128 rows, the key bucket the step picks, one graph of all
layers), in ms a token and GB/s of K and V bytes read, beside the device's own copy rate (the floor).

    python scripts/decode_attention_rates.py --depths 8192,32768 \
        --settings='-;attention_target_programs=1024;attention_min_chunk=128 attention_target_programs=1024'
"""

from __future__ import annotations

import argparse

import torch
from matvec_shapes import time_us  # scripts/ is on the path when run as a script
from with_settings import changes

from moestream.kernels import decode_attention, tuning
from moestream.runtime.step import key_bucket


def copy_rate() -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write bytes): what the cache reads are measured against."""
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * a.nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def per_token_ms(layers: int, depth: int, heads: int, kv_heads: int, head_dim: int, reps: int) -> float:
    """ms a token for `layers` layers' decode attention at position `depth`, replayed from one CUDA graph."""
    n_ctx = depth + 128
    s = key_bucket(depth, n_ctx)
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = [
        [torch.randn((s, kv_heads, head_dim), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for _ in range(layers)
    ]
    q = torch.randn((1, heads, head_dim), generator=g, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([depth], device="cuda")

    def step() -> None:
        for k, v in caches:
            decode_attention.attention(q, k, v, pos)

    return time_us(step, calls=1, reps=reps) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="8192,32768")
    p.add_argument("--settings", default="-", help="';'-separated kernel tuning settings ('-': the defaults)")
    p.add_argument("--layers", type=int, default=48)  # qwen3-30b-a3b: 48 layers, 32 heads, 4 KV heads of 128
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: device copy {rate:.0f} GB/s")
    print("| setting | depth | ms a token | GB/s of K+V | of the copy rate |")
    print("|---|---:|---:|---:|---:|")
    for setting in a.settings.split(";"):
        fields = changes([] if setting.strip() == "-" else setting.split())
        for depth in (int(d) for d in a.depths.split(",")):
            with tuning.use(**fields):
                ms = per_token_ms(a.layers, depth, a.heads, a.kv_heads, a.head_dim, a.reps)
            torch.cuda.empty_cache()  # the last depth's caches and graph
            read = a.layers * 2 * (depth + 1) * a.kv_heads * a.head_dim * 2  # bytes of K and V up to the position
            gbs = read / (ms / 1e3) / 1e9
            print(f"| {setting.strip()} | {depth} | {ms:.3f} | {gbs:.0f} | {gbs / rate:.0%} |", flush=True)


if __name__ == "__main__":
    main()
