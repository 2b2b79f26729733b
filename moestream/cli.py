"""The `moestream` command: parse flags into the options the Python API takes, print, exit 2 on bad input."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from moestream.errors import MoestreamError


def _engine_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Flags shared by run, bench and profile; with lists=True the numeric ones take comma lists."""
    num = _int_list if lists else int
    p.add_argument("-m", "--model", required=True, help="path of a GGUF model file")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (default: bf16 on GPU, f32 on CPU)")
    p.add_argument("-ub", "--ubatch", type=num, default=[512] if lists else 512, help="prefill micro-batch size")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens (default 4096)")
    p.add_argument(
        "-ncmoe",
        "--n-cpu-moe",
        type=_ncmoe_list if lists else _ncmoe,
        default=[0] if lists else 0,
        help="keep the experts of the first N layers in host RAM and stream them; all or auto",
    )
    p.add_argument("--cpu-moe", action="store_true", help="keep every layer's experts in host RAM")
    p.add_argument(
        "--streamed-layers",
        type=_str_list if lists else str,
        default=["first"] if lists else "first",
        help="which N layers stream: first (0..N-1, as llama.cpp) or spread (evenly spaced)",
    )
    p.add_argument("--vram-budget", default=None, help="cap on GPU memory, e.g. 12GiB (with -ncmoe auto: fit)")
    p.add_argument(
        "--stream",
        type=_str_list if lists else str,
        default=None,
        help="serial, pinned, overlap or layer-major (default: $MOESTREAM_STREAM or overlap)",
    )
    p.add_argument("--slots", type=num, default=[3] if lists else 3, help="staging slots in the ring (>= 2)")
    p.add_argument(
        "--stream-min-batch",
        type=int,
        default=32,
        help="micro-batches smaller than this do not upload whole layers (see --small-batch)",
    )
    p.add_argument(
        "--small-batch",
        default="upload",
        choices=("upload", "cpu"),
        help="below --stream-min-batch: upload only the chosen experts (default) or compute them on the CPU",
    )


def _ncmoe(text: str) -> int | str:
    return text if text in ("all", "auto") else _int(text)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    return [_int(t) for t in text.split(",")]


def _ncmoe_list(text: str) -> list[int | str]:
    return [_ncmoe(t) for t in text.split(",")]


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",")]


def _engine_options(a: argparse.Namespace) -> dict:
    """The options every command shares; list-valued flags (bench) give their first value here."""
    first = (lambda v: v[0]) if isinstance(a.ubatch, list) else (lambda v: v)
    ncmoe = "all" if a.cpu_moe else first(a.n_cpu_moe)
    stream = first(a.stream) if a.stream is not None else None
    opts = dict(
        device=a.device,
        dtype=a.dtype,
        ubatch=first(a.ubatch),
        n_cpu_moe=ncmoe,
        vram_budget=a.vram_budget,
        stream=stream,
        slots=first(a.slots),
        stream_min_batch=a.stream_min_batch,
        streamed_layers=first(a.streamed_layers),
        small_batch=a.small_batch,
    )
    if a.ctx is not None:
        opts["n_ctx"] = a.ctx
    return opts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text from a prompt")
    _engine_flags(run)
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    run.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    info = sub.add_parser("info", help="architecture, shapes, quant mix and expert bytes of a model file")
    info.add_argument("model")
    info.add_argument("--routing", action="store_true", help="also print per-layer expert load on a random prompt")
    info.add_argument("--tokens", type=int, default=2048, help="prompt length for --routing")
    info.add_argument("--device", default="auto")

    bench = sub.add_parser("bench", help="prefill/decode tokens/s per placement and schedule, against the floors")
    _engine_flags(bench, lists=True)
    bench.add_argument("-p", "--n-prompt", type=_int_list, default=[512], help="prompt lengths, e.g. 512,2048")
    bench.add_argument("-n", "--n-gen", type=_int_list, default=[0], help="decode lengths (0: prefill only)")
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--no-floors", action="store_true", help="skip the all-resident compute-floor runs")
    bench.add_argument("--json", action="store_true", help="print rows as JSON")

    prof = sub.add_parser("profile", help="timeline of one prefill pass per schedule: idle %, link GB/s, overlap")
    _engine_flags(prof, lists=True)
    prof.add_argument("-p", "--n-prompt", type=int, default=2048, help="prompt length")
    prof.add_argument("-r", "--repetitions", type=int, default=3, help="passes timed with recording on and off")
    prof.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    prof.add_argument("--plot", default=None, help="write a PNG timeline (a row per schedule) here")
    prof.add_argument("--json", default=None, help="write the summaries as JSON here")

    probe = sub.add_parser("probe", help="this machine's link and GEMM rates, and the floors of a run")
    probe.add_argument("--device", default="auto")
    probe.add_argument("-m", "--model", default=None, help="also print the floors of this model's prefill")
    probe.add_argument("-p", "--n-prompt", type=int, default=2048)
    probe.add_argument("-ub", "--ubatch", type=int, default=2048)
    probe.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0)

    make = sub.add_parser("make-model", help="write a GGUF model with random weights of a preset's shapes")
    make.add_argument("out")
    make.add_argument("--preset", required=True)
    make.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    make.add_argument("--quant", default="Q4_K_M", help="F32, BF16, Q8_0 or Q4_K_M")
    make.add_argument("--seed", type=int, default=0)
    return parser


def cmd_run(a: argparse.Namespace) -> None:
    from moestream.runtime.loader import load
    from moestream.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=a.n_predict, temperature=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    engine = load(a.model, **_engine_options(a))
    try:
        gen = engine.generate(a.prompt, params, chat=a.chat, on_text=lambda s: print(s, end="", flush=True))
    finally:
        engine.close()
    print()
    print(
        f"prompt {len(gen.prompt_tokens)} tokens, {gen.prefill_tps:.1f} tok/s | "
        f"generated {len(gen.tokens)} tokens, {gen.decode_tps:.1f} tok/s | stop: {gen.stop_reason}",
        file=sys.stderr,
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def cmd_info(a: argparse.Namespace) -> None:
    from moestream.formats.gguf import GGUFFile
    from moestream.runtime.loader import describe, expert_bytes_per_layer

    with GGUFFile(a.model) as f:
        _, s = describe(f)
        print(f"file          {f.path} ({_size(f.path.stat().st_size)})")
        print(f"architecture  {s.arch}   name: {f.metadata.get('general.name', '?')}")
        print(f"layers        {s.n_layer}   hidden {s.n_embd}   vocab {s.n_vocab}   context {s.n_ctx_train}")
        print(f"attention     {s.n_head} heads / {s.n_head_kv} KV heads x {s.head_dim}   rope base {s.rope_base:g}")
        print(f"experts       {s.n_expert}, {s.n_expert_used} used per token, FFN {s.n_ff_exp}")
        mix = Counter()
        for t in f.tensors.values():
            mix[t.qtype.name] += t.nbytes
        print("quant mix     " + ", ".join(f"{k} {_size(v)}" for k, v in mix.most_common()))
        per_layer = expert_bytes_per_layer(f, s)
        print(
            f"expert bytes  {_size(sum(per_layer))} total; per layer: "
            + " ".join(_size(b) for b in per_layer[:8])
            + (" ..." if len(per_layer) > 8 else "")
        )
        print(f"other bytes   {_size(sum(t.nbytes for t in f.tensors.values()) - sum(per_layer))}")
    if a.routing:
        _at_least(a.tokens, 1, "--tokens")
        from moestream.profiling.routing import routing_load
        from moestream.runtime.loader import load

        engine = load(a.model, device=a.device, n_ctx=a.tokens)
        try:
            counter = routing_load(engine, a.tokens)
        finally:
            engine.close()
        print(f"routing on {a.tokens} random tokens: per layer min / mean / max load, max/mean, idle experts")
        for il, (row, ratio) in enumerate(zip(counter.counts, counter.imbalance(), strict=True)):
            idle = int((row == 0).sum())
            print(
                f"  layer {il:3d}  {int(row.min()):6d} {row.float().mean():8.1f} {int(row.max()):6d}"
                f"   {float(ratio):4.2f}x   {idle} idle"
            )


def cmd_bench(a: argparse.Namespace) -> None:
    import json
    from dataclasses import asdict

    from moestream.runtime.bench import run_bench
    from moestream.runtime.loader import load

    _at_least(a.repetitions, 1, "-r")
    for n in a.n_prompt:
        _at_least(n, 0, "-p")
    for n in a.n_gen:
        _at_least(n, 0, "-n")
    if max(a.n_prompt) == 0 and max(a.n_gen) == 0:
        raise MoestreamError("-p 0 -n 0: nothing to measure; give a prompt length (-p) or a decode length (-n)")
    streams = a.stream or ["overlap"]
    opts = _engine_options(a) | {"progress": not a.json}
    opts.setdefault("n_ctx", max(a.n_prompt) + max(a.n_gen) + 1)
    engine = load(a.model, **opts)
    header = (
        f"| {'model':<28} | {'size':>9} | {'ncmoe':>5} | {'layers':<6} | {'ub':>5} | {'stream':<11} | {'test':>7} | "
        f"{'t/s':>18} | {'GB up':>7} | {'used':>5} | {'GB/s':>6} | same |"
    )

    def show(r) -> None:
        if not a.json:
            same = ("yes" if r.same_tokens else "NO") + ("" if r.same_bits in (None, True) else "*")
            print(
                f"| {r.model[:28]:<28} | {r.size_gib:6.2f} GiB | {r.n_cpu_moe:>5} | {r.streamed_layers:<6} | "
                f"{r.ubatch:>5} | "
                f"{r.stream:<11} | {r.test:>7} | {r.tps:9.1f} ± {r.tps_std:6.1f} | {r.bytes_uploaded / 1e9:7.2f} | "
                f"{r.experts_used:5.2f} | {r.link_gbs:6.1f} | {same:<4} |",
                flush=True,
            )

    if not a.json:
        print(header)
        print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    try:
        rows, link = run_bench(
            engine,
            a.n_prompt,
            a.n_gen,
            a.ubatch,
            ["all" if a.cpu_moe else n for n in a.n_cpu_moe],
            streams,
            a.slots,
            a.streamed_layers,
            a.repetitions,
            floors=not a.no_floors,
            progress=show,
        )
    finally:
        engine.close()
    if a.json:
        print(json.dumps({"link_gbs": link / 1e9, "rows": [asdict(r) for r in rows]}, indent=1))
        return
    print(f"\npinned host-to-device link: {link / 1e9:.1f} GB/s (measured now)")
    if not a.no_floors:
        print("floors per row: transfer = bytes up / link, compute = same test with every expert resident")
        for r in rows:
            bound = max(r.transfer_floor_s, r.compute_floor_s)
            print(
                f"  ncmoe {r.n_cpu_moe:>2} ub {r.ubatch:>5} {r.stream:<11} {r.test:>7}: {r.seconds * 1e3:8.1f} ms; "
                f"transfer {r.transfer_floor_s * 1e3:7.1f} ms, compute {r.compute_floor_s * 1e3:7.1f} ms, "
                f"time / max(floors) = {r.seconds / bound if bound else float('nan'):.2f}"
            )
    print(
        "same: greedy next token equals the first row's; * marks logits not bit-identical to the first row "
        "with the same ubatch"
    )


def cmd_profile(a: argparse.Namespace) -> None:
    import json

    from moestream.profiling.session import profile_pass
    from moestream.runtime.bench import random_prompt
    from moestream.runtime.loader import load

    _at_least(a.n_prompt, 1, "-p")
    _at_least(a.repetitions, 1, "-r")
    for path, flag in ((a.trace, "--trace"), (a.plot, "--plot"), (a.json, "--json")):
        _writable(path, flag)
    opts = _engine_options(a)
    opts.setdefault("n_ctx", a.n_prompt + 1)
    engine = load(a.model, **opts)
    results = []
    try:
        tokens = random_prompt(a.n_prompt, engine.spec.n_vocab)
        for schedule in a.stream or ["serial", "overlap"]:
            r = profile_pass(engine, tokens, schedule, a.repetitions)
            results.append(r)
            print(
                f"\n== {schedule}: pp{a.n_prompt} ub{opts['ubatch']} ncmoe {engine.offload.placement.n_cpu_moe}: "
                f"{r.wall_off_s * 1e3:.1f} ms unrecorded, {r.wall_on_s * 1e3:.1f} ms recorded "
                f"({r.overhead_pct:+.1f}%)"
            )
            print(r.summary.table())
    finally:
        engine.close()
    runs = {r.schedule: r.spans for r in results}
    if a.trace:
        from moestream.profiling.trace import write_chrome_trace

        write_chrome_trace(runs, a.trace)
        print(f"wrote {a.trace}")
    if a.plot:
        from moestream.profiling.plot import plot_timelines

        plot_timelines(runs, a.plot, title=f"{engine.spec.arch} pp{a.n_prompt} ub{opts['ubatch']}")
        print(f"wrote {a.plot}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    r.schedule: r.summary.as_dict() | {"wall_on_s": r.wall_on_s, "wall_off_s": r.wall_off_s}
                    for r in results
                },
                f,
                indent=1,
            )


def cmd_probe(a: argparse.Namespace) -> None:
    import torch

    from moestream.profiling.probe import grouped_gemm_rate, h2d_rate, registered_rate
    from moestream.runtime.options import EngineOptions

    _at_least(a.ubatch, 1, "-ub")
    _at_least(a.n_prompt, 1, "-p")
    device = EngineOptions(device=a.device).torch_device  # the same checks as every other command
    size = 1 << 30 if device.type == "cuda" else 1 << 26
    pinned, pageable = h2d_rate(device, size), h2d_rate(device, size, pinned=False)
    print(f"host-to-device: pinned {pinned / 1e9:.1f} GB/s, pageable {pageable / 1e9:.1f} GB/s ({device})")
    spec, f = None, None
    if a.model:
        from moestream.formats.gguf import GGUFFile
        from moestream.runtime.loader import describe, expert_bytes_per_layer

        f = GGUFFile(a.model)
        _, spec = describe(f)
        if device.type == "cuda":
            region = max(f.tensors.values(), key=lambda t: t.nbytes).data
            print(f"registered mmap (page-locked in place): {registered_rate(device, region) / 1e9:.1f} GB/s")
    shape = (spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_expert_used) if spec else (2048, 768, 128, 8)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm = grouped_gemm_rate(a.ubatch, *shape, device=device, dtype=dtype)
    print(
        f"grouped expert GEMM (D={shape[0]}, F={shape[1]}, E={shape[2]}, top-{shape[3]}, "
        f"{a.ubatch} tokens, {dtype}): {gemm / 1e12:.1f} TFLOP/s"
    )
    if spec is not None:
        n_chunks = -(-a.n_prompt // a.ubatch)
        if not 0 <= a.n_cpu_moe <= spec.n_layer:
            raise MoestreamError(f"--n-cpu-moe {a.n_cpu_moe}: must be between 0 and {spec.n_layer} (the layer count)")
        streamed = sum(expert_bytes_per_layer(f, spec)[: a.n_cpu_moe])
        f.close()
        flops = 6 * a.n_prompt * spec.n_expert_used * spec.n_embd * spec.n_ff_exp * spec.n_layer
        print(f"floors for pp{a.n_prompt} ub{a.ubatch} ncmoe {a.n_cpu_moe}:")
        print(
            f"  transfer: token-major {n_chunks * streamed / pinned * 1e3:.1f} ms "
            f"({n_chunks} x {streamed / 1e9:.2f} GB), layer-major {streamed / pinned * 1e3:.1f} ms"
        )
        print(
            f"  compute (expert GEMMs only, at the rate above): {flops / gemm * 1e3:.1f} ms; "
            "`moestream bench` measures the full compute floor (every expert resident)"
        )


def cmd_make_model(a: argparse.Namespace) -> None:
    from moestream.models.presets import get_preset
    from moestream.models.synthetic import make_model

    preset = get_preset(a.preset, a.layers)
    _writable(a.out, "make-model")
    make_model(a.out, preset, quant=a.quant, seed=a.seed)
    print(f"wrote {a.out}: preset {preset.name}, {preset.n_layer} layers, {a.quant}")


COMMANDS = {
    "run": cmd_run,
    "info": cmd_info,
    "bench": cmd_bench,
    "profile": cmd_profile,
    "probe": cmd_probe,
    "make-model": cmd_make_model,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"moestream: error: out of memory ({first}); lower --ctx or --ubatch, stream more layers "
            "(--n-cpu-moe, or --n-cpu-moe auto --vram-budget SIZE), or use fewer --slots",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError on a GPU; on the CPU the allocator raises a RuntimeError saying so."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _writable(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when an output path cannot be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise MoestreamError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise MoestreamError(f"{flag} {path}: the folder {p.parent} does not exist")


def _at_least(value: int, least: int, flag: str) -> None:
    if value < least:
        raise MoestreamError(f"{flag} {value}: must be at least {least}")


if __name__ == "__main__":
    sys.exit(main())
