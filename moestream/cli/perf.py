"""`moestream bench`, `profile` and `probe`: measure a run against the machine's floors and show where time goes."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from moestream.cli.args import at_least, check_engine, check_model_path, engine_options, writable
from moestream.errors import MoestreamError
from moestream.options import Schedule, format_size
from moestream.tools.sweep import Sweep

if TYPE_CHECKING:
    from moestream.tools.bench import BenchRow


def sweep_of(a: argparse.Namespace) -> Sweep:
    return Sweep(
        prompts=a.n_prompt,
        gens=a.n_gen,
        ubatches=a.ubatch if a.batch_size is None else [min(u, a.batch_size) for u in a.ubatch],
        n_cpu_moes=["all" if a.cpu_moe else n for n in a.n_cpu_moe],
        streams=a.stream or [str(Schedule.default())],
        slots=a.slots,
        picks=a.streamed_layers,
        prefetches=a.prefetch or [None],
        aheads=a.prefetch_ahead,
        cpu_layers=a.cpu_layers,
        caches=a.expert_cache or ["auto"],
        depths=a.n_depth,
        types_k=a.cache_type_k,
        types_v=a.cache_type_v,
        repeats=a.repetitions,
        floors=not a.no_floors,
        text=a.text,
    )


def check_bench(a: argparse.Namespace) -> None:
    at_least(a.repetitions, 1, "-r")
    for n in a.n_prompt:
        at_least(n, 0, "-p")
    for n in a.n_gen:
        at_least(n, 0, "-n")
    for n in a.n_depth:
        at_least(n, 0, "-d")
    if max(a.n_prompt) == 0 and max(a.n_gen) == 0:
        raise MoestreamError("-p 0 -n 0: nothing to measure; give a prompt length (-p) or a decode length (-n)")
    if a.batch_size is not None:
        at_least(a.batch_size, 1, "-b")
    if a.text is not None:
        from moestream.tools.tokens import read_text

        read_text(a.text)
    check_engine(a, _positions(a) + 1, sweep_of(a).placements())  # every row, before the first


def cmd_bench(a: argparse.Namespace) -> None:
    from moestream.cli import report
    from moestream.offload.builder import check_expert_counts
    from moestream.runtime.loader import load
    from moestream.tools.bench import model_name, run_bench

    fmt = "json" if a.json else a.output
    longest = _positions(a)
    opts = engine_options(a, ctx=longest + 1).replace(progress=fmt == "md")
    sweep = sweep_of(a)
    # every row's values against the model's shapes before its weights load: a bad row would fail only after
    # the rows before it had run
    row_options = [opts.replace(**placed) for placed in sweep.placements()]

    def fits(_, n_ctx: int, spec) -> None:
        _fits(longest, n_ctx)
        for row in row_options:
            check_expert_counts(row, spec)

    engine = load(a.model, opts, before_weights=fits)
    info = report.run_info(engine, a.batch_size or max(max(a.n_prompt), max(a.ubatch)))
    if fmt == "md":
        print(report.md_header(model_name(engine)))
    try:
        rows, link = run_bench(
            engine,
            sweep,
            progress=(lambda r: print(report.md_row(r, info), flush=True)) if fmt == "md" else None,
            say=lambda text: print(f"moestream: bench: {text}", file=sys.stderr, flush=True),
        )
    finally:
        engine.close()
    if fmt != "md":
        print(report.render(fmt, [report.record(r, info, link) for r in rows]))
        return
    print(f"\npinned host-to-device link: {link / 1e9:.1f} GB/s (measured now)")
    if not a.no_floors:
        print(
            "floors per row: transfer = bytes up / link, compute = the best run of the same test with every expert "
            "resident; the time is the rows' mean, so on a busy machine time / max(floors) may fall under 1"
        )
        for r in rows:
            bound = max(r.transfer_floor_s, r.compute_floor_s)
            print(
                f"  ncmoe {r.n_cpu_moe:>2} ub {r.ubatch:>5} {r.stream:<11} {_prefetch_cache(r)} {r.test:>7}: "
                f"{r.seconds * 1e3:8.1f} ms; "
                f"transfer {r.transfer_floor_s * 1e3:7.1f} ms, compute {r.compute_floor_s * 1e3:7.1f} ms, "
                f"time / max(floors) = {r.seconds / bound if bound else float('nan'):.2f}"
                + (f"; peak GPU memory {r.gpu_peak_gib:.2f} GiB" if info["backends"] == "CUDA" else "")
            )
    print(
        "GB/s: bytes uploaded over the run; cp GB/s: over the time the copies took (the link while copying, "
        "from copy-stream events of the warm-up pass)\n"
        "same: greedy next token equals the first row's; * marks logits not bit-identical to the first row "
        "with the same ubatch"
    )
    for r in rows:
        if r.links_gbs:
            each = " + ".join(f"{g:.1f}" for g in r.links_gbs)
            print(f"  {r.test} {r.stream}: each --devices link, GB/s over the run: {each} = {sum(r.links_gbs):.1f}")
        if r.kind == "tg":
            n = r.n_tokens
            guess = (
                ""
                if r.prefetch_hit is None
                else f", prefetch {r.prefetch} a layer {r.prefetch_ahead} ahead: {r.prefetch_hit:.1%} of picks guessed"
            )
            if r.cache_hit is not None:
                guess += f", expert cache {r.expert_cache} a layer: {r.cache_hit:.1%} of picks held"
            print(
                f"  {r.test} ncmoe {r.n_cpu_moe} {r.streamed_layers} {r.small_batch} {_prefetch_cache(r)}: "
                f"{r.seconds / n * 1e3:.2f} ms a "
                f"token, {r.bytes_uploaded / n / 1e6:.1f} MB of experts fetched a token{guess}"
            )


def _prefetch_cache(r: BenchRow) -> str:
    """The row's --prefetch, --prefetch-ahead, --expert-cache and --cpu-layers, so the lines under the table tell
    apart the rows they sweep."""
    cpu = f" cpu layers {r.cpu_layers}" if r.cpu_layers else ""
    return f"pf {r.prefetch} ahead {r.prefetch_ahead} cache {r.expert_cache}{cpu}"


def _positions(a: argparse.Namespace) -> int:
    """The positions bench sizes its context for: the deepest -d, then the longest -p and -n."""
    return max(a.n_depth) + max(a.n_prompt) + max(a.n_gen)


def _fits(tokens: int, n_ctx: int) -> None:
    """-d plus -p or -n against the positions the model gives, before any weight moves."""
    if tokens + 1 > n_ctx:
        raise MoestreamError(
            f"-p, -n and -d (the depth before them) ask for {tokens} positions but the context has {n_ctx} (the "
            f"model's, or --ctx); give smaller values, at most {n_ctx - 1} positions in all"
        )


def check_profile(a: argparse.Namespace) -> None:
    at_least(a.n_prompt, 1, "-p")
    at_least(a.repetitions, 1, "-r")
    for path, flag in ((a.trace, "--trace"), (a.plot, "--plot"), (a.json, "--json")):
        writable(path, flag)
    check_engine(a, a.n_prompt + 1, [{"stream": s} for s in a.stream or []])  # each schedule's name now


def cmd_profile(a: argparse.Namespace) -> None:
    import json

    from moestream.runtime.loader import load
    from moestream.tools.profile import profile_pass
    from moestream.tools.tokens import random_prompt

    opts = engine_options(a, ctx=a.n_prompt + 1)
    engine = load(a.model, opts, before_weights=lambda _, n_ctx, spec: _fits(a.n_prompt, n_ctx))
    results = []
    try:
        tokens = random_prompt(a.n_prompt, engine.spec.n_vocab)
        for schedule in a.stream or ["serial", "overlap"]:
            r = profile_pass(
                engine,
                tokens,
                schedule,
                a.repetitions,
                say=lambda text: print(f"moestream: profile: {text}", file=sys.stderr, flush=True),
            )
            results.append(r)
            print(
                f"\n== {schedule}: pp{a.n_prompt} ub{opts.model.ubatch} ncmoe {engine.offload.placement.n_cpu_moe}: "
                f"{r.wall_off_s * 1e3:.1f} ms a pass unrecorded, {r.wall_on_s * 1e3:.1f} ms recorded (medians of "
                f"{a.repetitions}; the table is that recorded pass) "
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

        plot_timelines(runs, a.plot, title=f"{engine.spec.arch} pp{a.n_prompt} ub{opts.model.ubatch}")
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


def check_probe(a: argparse.Namespace) -> None:
    from moestream.options import Options

    check_model_path(a)
    at_least(a.ubatch, 1, "-ub")
    at_least(a.n_prompt, 1, "-p")
    if a.n_cpu_moe == "auto":
        raise MoestreamError("-ncmoe auto fits layers to a --vram-budget at load; probe takes a count or all")
    if a.n_cpu_moe != "all":
        at_least(a.n_cpu_moe, 0, "-ncmoe")  # the range first: -ncmoe -1 is wrong with or without -m
    if a.model is None and a.n_cpu_moe:
        raise MoestreamError(
            f"-ncmoe {a.n_cpu_moe} streams layers of a model: give -m MODEL too (without -m, probe measures the "
            "link and the expert GEMM rate only)"
        )
    Options.check(device=a.device)


def cmd_probe(a: argparse.Namespace) -> None:
    import torch

    from moestream.options import Options
    from moestream.tools.probe import grouped_gemm_rate, h2d_rate, registered_rate

    device = Options.make(device=a.device).model.torch_device  # the same checks as every other command
    from moestream.kernels.compiles import cache_dirs
    from moestream.runtime.way_memory import memory_file

    print("kernel caches: " + "; ".join(f"{what} {where}" for what, where in cache_dirs().items()))
    print(f"--small-batch auto's choices: {memory_file()} (delete it to measure again)")
    spec, streamed, registered = None, 0, None
    if a.model is not None:  # -m '': the file's own error
        from moestream.formats.gguf import GGUFFile
        from moestream.models.describe import describe, expert_bytes_per_layer
        from moestream.offload.builder import streamed_layers

        with GGUFFile(a.model) as f:
            _, spec = describe(f)
            n_cpu_moe, note = streamed_layers(a.n_cpu_moe, spec.n_layer)
            if note:
                print(note)
            streamed = sum(expert_bytes_per_layer(f, spec)[:n_cpu_moe])
            if device.type == "cuda":
                registered = registered_rate(device, max(f.tensors.values(), key=lambda t: t.nbytes).data)
    size = 1 << 30 if device.type == "cuda" else 1 << 26
    pinned, pageable = h2d_rate(device, size), h2d_rate(device, size, pinned=False)
    print(f"host-to-device: pinned {pinned / 1e9:.1f} GB/s, pageable {pageable / 1e9:.1f} GB/s ({device})")
    if registered is not None:
        print(f"registered mmap (page-locked in place): {registered / 1e9:.1f} GB/s")
    if spec is not None:
        shape = (spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_expert_used)
    else:  # Qwen3-30B-A3B's expert shape; on the CPU 16 experts, top-1: the same rows per expert, 1/8 the memory
        shape = (2048, 768, 128, 8) if device.type == "cuda" else (2048, 768, 16, 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm = grouped_gemm_rate(a.ubatch, *shape, device=device, dtype=dtype)
    print(
        f"grouped expert GEMM (D={shape[0]}, F={shape[1]}, E={shape[2]}, top-{shape[3]}, "
        f"{a.ubatch} tokens, {dtype}): {gemm / 1e12:.1f} TFLOP/s"
    )
    if spec is not None:
        n_chunks = -(-a.n_prompt // a.ubatch)
        flops = 6 * a.n_prompt * spec.n_expert_used * spec.n_embd * spec.n_ff_exp * len(spec.expert_layers)
        print(f"floors for pp{a.n_prompt} ub{a.ubatch} ncmoe {a.n_cpu_moe}:")
        print(
            f"  transfer: token-major {n_chunks * streamed / pinned * 1e3:.1f} ms "
            f"({n_chunks} x {format_size(streamed)}), layer-major {streamed / pinned * 1e3:.1f} ms"
        )
        print(
            f"  compute (expert GEMMs only, at the rate above): {flops / gemm * 1e3:.1f} ms; "
            "`moestream bench` measures the full compute floor (every expert resident)"
        )
