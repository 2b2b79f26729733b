"""The CPU side of `--small-batch cpu`, side by side: one token's 8 chosen experts of a layer computed by the
compiled matvec on the stored blocks (x rounded to int8, as beside a GPU; x in float32, as on the CPU device)
vs dequantized to float32 in torch (the path before it). Prints ms per layer and the stored bytes read per
second; timed after a warm-up, the best of several repeats of the same 8 experts (which a large L3 holds), and
the host function once more over every expert in turn, new ones each call (read from DRAM, as in decode), and
for a batch of 4 tokens (without and with half their picks shared) in one call against each token alone.

    python scripts/cpu_experts.py MODEL [--layer 0] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from moestream.formats.gguf import GGUFFile
from moestream.kernels import cpu_quant, host_swiglu
from moestream.kernels.gather import RowGather
from moestream.models.describe import describe
from moestream.offload.expert_tensors import ExpertTensors
from moestream.ops.experts import matvecs
from moestream.ops.moe_swiglu import moe_swiglu, moe_swiglu_picked
from moestream.profiling.timeline import NULL


def best(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with GGUFFile(a.model) as f:
        arch, spec = describe(f)
        t = ExpertTensors(tuple(f.tensor(n) for n in arch.expert_tensor_names(a.layer)))
        K = spec.n_expert_used
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, spec.n_embd, generator=g)
        ids = torch.randperm(t.n_expert, generator=g)[:K].view(1, K)
        weights = torch.full((1, K), 1.0 / K)
        raws = t.host_bytes()

        stored = t.stored(raws, ids, torch.float32, NULL, a.layer, RowGather(), on_host=True)

        def compiled():
            return moe_swiglu_picked(x, weights, ids, *matvecs(cpu_quant.matvec, stored))

        def host_function():  # what --small-batch cpu queues beside a GPU, run here on the CPU
            return host_swiglu.swiglu(x, weights, ids, stored.raws, stored.qtypes)

        def compiled_int8():
            return moe_swiglu_picked(x, weights, ids, *matvecs(partial(cpu_quant.matvec, int8=True), stored))

        def torch_dequant():
            used = torch.unique(ids)
            local = torch.full((t.n_expert,), -1, dtype=torch.long)
            local[used] = torch.arange(used.numel())
            stacks = [lambda s=s: stored.dequantize(s, used) for s in range(3)]
            return moe_swiglu(x, weights, local[ids], used.numel(), *stacks)

        err = float((compiled() - torch_dequant()).abs().max() / torch_dequant().abs().max())
        nbytes = K * (t.nbytes // t.n_expert)
        print(f"{a.model}: layer {a.layer}, {K} experts = {nbytes / 2**20:.1f} MiB, {torch.get_num_threads()} threads")
        ways = (
            ("host function, int8 x", host_function),
            ("compiled, int8 x", compiled_int8),
            ("compiled matvec", compiled),
            ("torch float32 dequant", torch_dequant),
        )
        for name, fn in ways:
            s = best(fn)
            print(f"  {name:<22} {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.2f} GB/s")
        turns = torch.randperm(t.n_expert, generator=g)[: t.n_expert // K * K].view(-1, 1, K)

        def host_function_all():
            for picks in turns:
                host_swiglu.swiglu(x, weights, picks, stored.raws, stored.qtypes)

        s = best(host_function_all, 3) / len(turns)
        print(f"  {'host function, DRAM':<22} {s * 1e3:8.2f} ms  {nbytes / s / 1e9:6.2f} GB/s ({K} new experts a call)")
        xs, w4 = torch.randn(4, spec.n_embd, generator=g), weights.expand(4, K)
        for shared in (0, K // 2):  # a batch of 4 tokens, `shared` of each one's picks the same experts
            calls = []
            for start in range(0, t.n_expert - 4 * K, 4 * K):  # new experts each call, read from DRAM
                own = torch.arange(start, start + 4 * K).view(4, K)
                own[:, :shared] = own[0, :shared]
                calls.append(own)

            def together(calls=calls):
                for picks in calls:
                    host_swiglu.swiglu(xs, w4, picks, stored.raws, stored.qtypes)

            def alone(calls=calls):
                for picks in calls:
                    for r in range(4):
                        host_swiglu.swiglu(xs[r : r + 1], weights, picks[r : r + 1], stored.raws, stored.qtypes)

            both = [best(fn, 3) / len(calls) * 1e3 for fn in (together, alone)]
            distinct = len(set(calls[0].flatten().tolist()))
            print(f"  4 tokens, {distinct} distinct of {4 * K} picks: together {both[0]:.2f} ms, alone {both[1]:.2f}")
        err8 = float((compiled_int8() - torch_dequant()).abs().max() / torch_dequant().abs().max())
        print(f"  max relative difference {err:.1e} (int8 x: {err8:.1e}); compiled available: {cpu_quant.available()}")


if __name__ == "__main__":
    main()
