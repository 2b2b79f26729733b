"""`moestream bench -o md|json|csv|jsonl`: rows under llama-bench's field names where they mean the same thing
(so scripts that read llama-bench output read ours), then moestream's own streaming fields."""

from __future__ import annotations

import csv
import io
import json
import math
import platform
import time

import torch

from moestream import __version__
from moestream.options import format_size

FORMATS = ("md", "json", "csv", "jsonl")
TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def run_info(engine, n_batch: int) -> dict:
    """The fields every row of one bench run shares (llama-bench's names), read before the engine closes."""
    f, spec = engine.source, engine.spec
    cuda = engine.device.type == "cuda"
    kv = TYPE_NAMES.get(engine.dtype, str(engine.dtype))
    return {
        "build_commit": f"moestream-{__version__}",
        "build_number": 0,
        "cpu_info": _cpu_name(),
        "gpu_info": torch.cuda.get_device_name(engine.device) if cuda else "",
        "backends": "CUDA" if cuda else "CPU",
        "model_filename": str(f.path),
        "model_type": f"{spec.arch} {f.metadata.get('general.name', '')}".strip(),
        "model_size": sum(t.nbytes for t in f.tensors.values()),
        "model_n_params": sum(math.prod(t.shape) for t in f.tensors.values()),
        "n_batch": n_batch,
        "n_threads": torch.get_num_threads(),
        "type_k": kv,
        "type_v": kv,
        "n_gpu_layers": spec.n_layer if cuda else 0,
        "flash_attn": -1,  # PyTorch's fused attention picks its kernel
        "use_mmap": True,
        "host_memory": engine.options.placement.host_memory,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def record(row, info: dict, link_bps: float) -> dict:
    """One row as llama-bench names it (n_prompt, n_gen, avg_ts...), then moestream's own fields."""
    n = row.n_tokens
    prompt = row.kind == "pp"
    ns = [s * 1e9 for s in row.samples_s]
    ts = [n / s for s in row.samples_s]
    rec = info | {
        "n_ubatch": row.ubatch,
        "n_cpu_moe": row.n_cpu_moe,
        "n_prompt": n if prompt else 0,
        "n_gen": 0 if prompt else n,
        "n_depth": row.n_depth,
        "type_k": row.type_k,
        "type_v": row.type_v,
        "test_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "avg_ns": round(sum(ns) / len(ns)),
        "stddev_ns": round(_stdev(ns)),
        "avg_ts": row.tps,
        "stddev_ts": _stdev(ts),
        "samples_ns": [round(x) for x in ns],
        "samples_ts": ts,
    }
    return rec | {
        "test": row.test,
        "stream": row.stream,
        "slots": row.slots,
        "streamed_layers": row.streamed_layers,
        "small_batch": row.small_batch,
        "prefetch": row.prefetch,
        "prefetch_ahead": row.prefetch_ahead,
        "prefetch_hit": row.prefetch_hit,
        "expert_cache": row.expert_cache,
        "cache_hit": row.cache_hit,
        "cache_policy": row.cache_policy,
        "cpu_layers": row.cpu_layers,
        "bytes_uploaded": row.bytes_uploaded,
        "bytes_per_token": row.bytes_uploaded / n,
        "tokens": row.tokens,
        "experts_used": row.experts_used,
        "link_gbs": row.link_gbs,
        "links_gbs": row.links_gbs,  # --devices: each device's link
        "copy_gbs": row.copy_gbs,
        "pinned_link_gbs": link_bps / 1e9,
        "gpu_peak_gib": row.gpu_peak_gib,
        "transfer_floor_s": row.transfer_floor_s,
        "compute_floor_s": row.compute_floor_s,
        "same_tokens": row.same_tokens,
        "same_bits": row.same_bits,
    }


def _stdev(xs: list[float]) -> float:
    """Sample standard deviation (Bessel's correction, as llama-bench), 0 for one sample."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def render(fmt: str, records: list[dict]) -> str:
    """json: an array; jsonl: an object a line; csv: a header and a row each (without the per-run samples)."""
    if fmt == "json":
        return json.dumps(records, indent=1)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in records)
    out = io.StringIO()
    fields = [k for k in records[0] if not k.startswith("samples_")] if records else []
    writer = csv.DictWriter(out, fields, extrasaction="ignore", quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue().rstrip("\n")


MD_COLUMNS = (
    f"| {'size':>10} | {'params':>9} | {'backend':<7} | {'n_cpu_moe':>9} | {'layers':<6} | "
    f"{'n_ubatch':>8} | {'type_k':>6} | {'type_v':>6} | {'stream':<11} | {'prefetch':>8} | {'cache':>5} | "
    f"{'test':>15} | {'t/s':>18} | "
    f"{'uploaded':>9} | {'used':>5} | {'GB/s':>6} | {'cp GB/s':>7} | same |"
)


def md_header(model: str) -> str:
    """llama-bench's markdown columns (model, size, params, backend, n_ubatch, test, t/s) and the streaming ones;
    the model's whole name as wide as it is."""
    columns = f"| {'model':<{len(model)}} " + MD_COLUMNS
    return columns + "\n|" + "|".join("-" * len(c) for c in columns.split("|")[1:-1]) + "|"


def md_row(r, info: dict) -> str:
    same = ("yes" if r.same_tokens else "NO") + ("" if r.same_bits in (None, True) else "*")
    cp = "-" if r.copy_gbs is None else f"{r.copy_gbs:.1f}"
    prefetch = (
        "-" if r.prefetch is None else f"{r.prefetch}" + (f" @{r.prefetch_ahead}" if r.prefetch_ahead > 1 else "")
    )
    return (
        f"| {r.model} | {format_size(info['model_size']):>10} | {_count(info['model_n_params']):>9} | "
        f"{info['backends']:<7} | {r.n_cpu_moe:>9} | {r.streamed_layers:<6} | {r.ubatch:>8} | {r.type_k:>6} | "
        f"{r.type_v:>6} | {r.stream:<11} | "
        f"{prefetch:>8} | {r.expert_cache:>5} | {r.test:>15} | {r.tps:9.2f} ± {r.tps_std:6.2f} | "
        f"{_decimal(r.bytes_uploaded):>9} | {r.experts_used:5.2f} | {r.link_gbs:6.1f} | {cp:>7} | {same:<4} |"
    )


def _count(n: float) -> str:
    """A parameter count as llama-bench prints it: B, M or K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale or unit == "K":
            return f"{n / scale:.2f} {unit}"
    return ""


def _decimal(n: float) -> str:
    """Bytes moved: GB, MB, kB or B, as the link rates beside them count."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
