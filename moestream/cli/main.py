"""The `moestream` command: parse flags into the options the Python API takes, print, exit 2 on bad input."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

from moestream.cli.args import (
    LISTS,
    at_least,
    check_engine,
    check_model_path,
    engine_flags,
    engine_options,
    int_list,
    logit_bias,
    model_path,
    ncmoe,
    writable,
)
from moestream.cli.llama import refuse_llama_flags
from moestream.cli.perf import check_bench, check_probe, check_profile, cmd_bench, cmd_probe, cmd_profile, sweep_of
from moestream.cli.warmup import add_warmup, check_warmup, cmd_warmup
from moestream.errors import MoestreamError, Terminated, is_out_of_memory
from moestream.options import PROMPT_CACHE_RAM_MIB, Options, count_of, driver_present, format_size
from moestream.tools.presets import PRESETS

DESCRIPTION = (
    "Run Mixture-of-Experts GGUF models bigger than the GPU: the experts of the first N layers stay in host RAM "
    "and stream to the GPU, overlapped with compute (llama.cpp's files and its --n-cpu-moe)."
)
EPILOG = (
    "Try it on a generated model: moestream make-model tiny.gguf --preset tiny && moestream run -m tiny.gguf -p "
    "'The capital of France is' -n 32. `moestream COMMAND --help` lists a command's flags."
)


class _Parser(argparse.ArgumentParser):
    """Flags taken only as spelled, and flag errors in one line, as every other bad input."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        # A word of a dash and a digit is a value (--vram-budget -1G, --temp -1e-3), not an unknown flag, so the
        # flag's own check names its range. argparse takes only -5 and -.5 so ("expected one argument" for the
        # rest); no flag here starts with a digit. Subcommands are made of this class too.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def _get_option_tuples(self, option_string: str) -> list:
        """No prefixes and no value glued to a short flag (-n5): allow_abbrev=False alone still reads -f as -fa,
        -co as -c o and -mli as -m li, so a llama.cpp flag we lack would land on one of ours."""
        return []

    def error(self, message: str):
        self.exit(2, f"moestream: error: {message} (`{self.prog} --help` lists the flags)\n")


class _Help(argparse.HelpFormatter):
    """Each flag's default said once: appended unless the help names it already (a default that depends on the
    machine or the environment) or there is none to say (unset, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    from moestream import __version__

    parser = _Parser(prog="moestream", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add = sub.add_parser

    def add_command(*args, **kwargs) -> argparse.ArgumentParser:
        command = _add(*args, formatter_class=_Help, **kwargs)
        command.add_argument("--version", action="version", version=f"moestream {__version__}")
        return command

    sub.add_parser = add_command

    run = sub.add_parser("run", help="generate text from a prompt")
    engine_flags(run)
    run.add_argument("-p", "--prompt", default=None, help="the prompt text")
    run.add_argument("-f", "--file", default=None, help="read the prompt from this file (instead of -p)")
    run.add_argument(
        "-n", "--n-predict", "--predict", type=int, default=64, help="tokens to generate (-1: until the end of text)"
    )
    run.add_argument("--temp", "--temperature", type=float, default=0.0, help="temperature; 0 = greedy")
    run.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0: all)")
    run.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set this likely (1: all)")
    run.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one's probability (0: off)"
    )
    run.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise recent tokens' logits (1: off)")
    run.add_argument("--repeat-last-n", type=int, default=64, help="recent tokens the penalties look at (0: off)")
    run.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from each recent token")
    run.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per use of a recent token")
    run.add_argument(
        "-l",
        "--logit-bias",
        type=logit_bias,
        action="append",
        default=[],
        metavar="TOKEN(+|-)BIAS",
        help="add BIAS to a token's logit, as llama.cpp: 15043+1, 15043-inf bans it (repeat the flag for more)",
    )
    run.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default -1: random)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text tokens")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument(
        "-no-cnv",
        "--no-conversation",
        "-st",
        "--single-turn",
        action="store_true",
        help="accepted for llama.cpp command lines: run generates once and exits",
    )
    refuse_llama_flags(run, "run")

    info = sub.add_parser("info", help="architecture, shapes, tensor types and expert bytes of a model file")
    model_path(info)
    info.add_argument(
        "--routing",
        action="store_true",
        help="also measure routing per layer: next-layer guess, previous-token reuse, top-10%% share, entropy",
    )
    info.add_argument("--text", default=None, help="text --routing runs (default: a shipped English text)")
    info.add_argument("--tokens", type=int, default=None, help="at most this many tokens for --routing (default 2048)")
    info.add_argument(
        "--device", default="auto", help="whose kernels the tensor types are checked against; runs --routing's prompt"
    )

    bench = sub.add_parser("bench", help="prefill/decode tokens/s per placement and schedule, against the floors")
    engine_flags(bench, lists=LISTS)
    bench.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths, e.g. 512,2048")
    bench.add_argument("-n", "--n-gen", type=int_list, default=[0], help="decode lengths (0: prefill only)")
    bench.add_argument(
        "-d",
        "--n-depth",
        type=int_list,
        default=[0],
        help="tokens of context before each test, as llama-bench (rows: tg128 @ d8192); their prefill is not timed",
    )
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs of each test")
    bench.add_argument("--no-floors", action="store_true", help="skip the all-resident compute-floor runs")
    bench.add_argument(
        "--text",
        default=None,
        help="run a text file's tokens (repeated to length; decode teacher-forced over them) instead of random ids",
    )
    bench.add_argument(
        "-o",
        "--output",
        default="md",
        choices=("md", "json", "csv", "jsonl"),
        help="md (a table, printed as rows finish), json, csv or jsonl: llama-bench's field names, then ours",
    )
    bench.add_argument("--json", action="store_true", help="the same as -o json")
    refuse_llama_flags(bench, "bench")

    prof = sub.add_parser("profile", help="timeline of one prefill pass per schedule: idle %%, link GB/s, overlap")
    engine_flags(prof, lists=("stream",))
    prof.add_argument("-p", "--n-prompt", type=int, default=2048, help="prompt length")
    prof.add_argument("-r", "--repetitions", type=int, default=3, help="passes timed with recording on and off")
    prof.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    prof.add_argument("--plot", default=None, help="write a PNG timeline (a row per schedule) here")
    prof.add_argument("--json", default=None, help="write the summaries as JSON here")
    refuse_llama_flags(prof, "profile")

    probe = sub.add_parser("probe", help="this machine's link and GEMM rates, and the floors of a run")
    model_path(probe, required=False, what="also print the floors of this model's prefill")
    probe.add_argument("--device", default="auto", help="cpu, cuda or cuda:N")
    probe.add_argument("-p", "--n-prompt", type=int, default=2048, help="prompt length of the floors")
    probe.add_argument("-ub", "--ubatch", "--ubatch-size", type=int, default=2048, help="micro-batch of the floors")
    probe.add_argument(
        "-ncmoe", "--n-cpu-moe", type=ncmoe, default=0, help="layers streamed in the floors (all: every one)"
    )

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8080, help="port to listen on")
    serve.add_argument(
        "--api-key-file",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, KEY the file's first line "
        "(default: $MOESTREAM_API_KEY, if set)",
    )
    serve.add_argument("--api-key", default=None, help="the key itself (visible in `ps`: prefer --api-key-file)")
    serve.add_argument("-a", "--alias", default=None, help="the model name the server reports (default: the file's)")
    serve.add_argument(
        "--max-seqs", "-np", "--parallel", type=int, default=4, help="sequences served at once (the rest queue)"
    )
    serve.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask")
    serve.add_argument(
        "--threads-http",
        type=int,
        default=-1,
        help="threads that template and tokenize prompts, off the event loop (default -1: --max-seqs + 4, or the "
        "cores but one if more)",
    )
    serve.add_argument(
        "-to",
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to read a request's headers, each read of its "
        "body, and an idle keep-alive connection's next request",
    )
    serve.add_argument("--max-connections", type=int, default=512, help="open connections at most (the rest closed)")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on Ctrl-C or SIGTERM: seconds running requests may finish before each is ended (a second Ctrl-C: now)",
    )
    serve.add_argument(
        "--reasoning-format",
        default="auto",
        choices=("none", "deepseek", "auto"),
        help="chat answers' <think> blocks and gpt-oss' analysis channel: apart as reasoning_content (deepseek, "
        "auto) or left in the content (none); a request's reasoning_format overrides it",
    )
    serve.add_argument(
        "--cache-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start each request from the longest prefix it shares with an earlier one (default: on)",
    )
    serve.add_argument(
        "-cram",
        "--cache-ram",
        type=int,
        default=PROMPT_CACHE_RAM_MIB,
        help=f"MiB of host RAM for prompt prefixes no sequence holds ({PROMPT_CACHE_RAM_MIB}; 0: none, -1: no limit)",
    )
    serve.add_argument(
        "-cb",
        "--cont-batching",
        "--metrics",
        action="store_true",
        help="accepted for llama-server command lines: sequences are batched and /metrics is served always",
    )
    refuse_llama_flags(serve, "serve")
    add_warmup(sub)

    make = sub.add_parser("make-model", help="write a GGUF model with random weights of a preset's shapes")
    make.add_argument("out", help="the GGUF file to write")
    make.add_argument("--preset", required=True, help="the shapes to copy: " + ", ".join(PRESETS))
    make.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    make.add_argument(
        "--quant",
        default="Q4_K_M",
        help="llama.cpp's recipe (its type for each tensor), in any case: Q8_0, Q4_K_M, IQ4_XS, MXFP4_MOE... "
        "(a wrong name lists them all), or F32 / BF16",
    )
    make.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    make.add_argument(
        "--routing",
        choices=("trained", "uniform"),
        default=None,
        help="trained: weights planted to route like a trained model (default where the preset has settings); "
        "uniform: plain random weights",
    )
    return parser


def check_run(a: argparse.Namespace) -> None:
    from moestream.runtime.sampling import SamplingParams

    if (a.prompt is None) == (a.file is None):
        raise MoestreamError("give the prompt once: -p TEXT or -f FILE")
    if a.file is not None:
        try:
            a.prompt = Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MoestreamError(f"-f {a.file}: {getattr(e, 'strerror', None) or e}; give a text file") from None
    if not a.prompt:
        raise MoestreamError(f"{'-p' if a.file is None else '-f ' + a.file}: the prompt is empty; give some text")
    try:
        a.prompt.encode("utf-8")  # a terminal's bytes that are no UTF-8 reach argv as lone surrogates
    except UnicodeEncodeError as e:
        raise MoestreamError(
            f"-p: the prompt is not UTF-8 text (character {e.start + 1}); set the terminal to UTF-8, or pass -f FILE"
        ) from None
    a.sampling = SamplingParams(
        max_tokens=a.n_predict,
        temperature=a.temp,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        repeat_last_n=a.repeat_last_n,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        seed=a.seed,
        stop_at_eos=not a.ignore_eos,
        logit_bias={t: sum(b for u, b in a.logit_bias if u == t) for t, _ in a.logit_bias},  # added up, as llama.cpp
    )
    check_engine(a)


def cmd_run(a: argparse.Namespace) -> None:
    from moestream.kernels import compiles, tuning

    opts = engine_options(a)
    rows = _run_rows(a.model, opts)
    cold = rows != tuning.current().unrolled
    with tuning.use(unrolled=rows):  # cold: nor does it time --small-batch auto's ways (each compiles its kernels)
        _run(a, opts.replace(measure_ways=False) if cold else opts)
    if compiles.summary() and cold:
        print(
            f"moestream: this run took the decode kernels that compile fastest (rows looped) and small batches by "
            f"rule; `moestream warmup -m {a.model}` (with this run's flags) compiles the ~2% faster kernels and "
            "times the small-batch ways, which later runs then take",
            file=sys.stderr,
        )


def _run_rows(path: str, opts: Options) -> int:
    """Rows unrolled in this run: the tuning's once a decode step of this file compiled them on this machine, else
    the looped ones, which compile in half the time (a fresh machine's first run, docs/benchmarks.md)."""
    from moestream.kernels import tuning
    from moestream.runtime import way_memory

    t = tuning.current()
    if opts.model.torch_device.type != "cuda":
        return t.unrolled  # no Triton kernels
    try:
        k = way_memory.rows_key(way_memory.file_identity(path), opts)
    except OSError:
        return t.unrolled  # the load says what is wrong with the path
    return t.unrolled if t.unrolled in way_memory.rows_compiled(k) else t.unrolled_cold


def _run(a: argparse.Namespace, opts: Options) -> None:
    from moestream.runtime.loader import load

    prompt: list[int] = []  # encoded once, before the weights load

    def prompt_fits(tokenizer, n_ctx: int, _spec) -> None:
        if tokenizer is None:
            raise MoestreamError(f"{a.model}: the file has no tokenizer, so it cannot read a text prompt")
        prompt.extend(tokenizer.encode_prompt(a.prompt, a.chat, n_ctx))
        if (n := len(prompt)) > n_ctx:
            raise MoestreamError(
                f"the prompt is {n} tokens but the context is {n_ctx} (--ctx, at most what the model was trained "
                "for); raise --ctx or shorten the prompt"
            )

    start = time.perf_counter()
    engine = load(a.model, opts, before_weights=prompt_fits)
    load_s = time.perf_counter() - start  # llama.cpp says its load time too: a first run's compiles show here
    if str(engine.source.metadata.get("general.name", "")).startswith("moestream-generated"):
        print(
            "moestream: note: this model has random weights (moestream make-model): expect gibberish", file=sys.stderr
        )
    try:
        gen = engine.generate(prompt, a.sampling, on_text=lambda s: print(s, end="", flush=True))
    except KeyboardInterrupt as e:  # say what was done before the interrupt, then exit 130
        gen = getattr(e, "generation", None)
        if gen is not None:
            print()
            _print_stats(gen, load_s)
        raise
    finally:
        engine.close()
    print()
    _print_stats(gen, load_s)


def _print_stats(gen, load_s: float) -> None:
    print(
        f"load {load_s:.2f} s | prompt {count_of(len(gen.prompt_tokens), 'token')} in {gen.prefill_s:.2f} s "
        "(first-use setup included) | "
        f"generated {count_of(len(gen.tokens), 'token')}"
        + (f", {gen.decode_tps:.1f} tok/s over {count_of(gen.decode_steps, 'step')}" if gen.decode_steps else "")
        + f" | stop: {gen.stop_reason}",
        file=sys.stderr,
    )


def _print_types(metadata: dict, tensors: list) -> None:
    """The file type and, like llama.cpp's loader, each tensor type's count (with its bytes), largest first."""
    from moestream.tools.recipes import RECIPES

    code = metadata.get("general.file_type")
    name = next((r.name for r in RECIPES.values() if r.file_type == code), "not one of llama.cpp's recipes")
    print(f"file type     {name} (general.file_type {code})" if code is not None else "file type     not recorded")
    count, size = Counter(), Counter()
    for t in tensors:
        count[t.qtype.name] += 1
        size[t.qtype.name] += t.nbytes
    for i, (qtype, n) in enumerate(size.most_common()):
        tensors = count_of(count[qtype], "tensor")
        print(f"{'tensor types' if i == 0 else '':14}{qtype:8} {tensors:>12} {format_size(n):>11}")


def _warn_fallbacks(f, s, device: str) -> None:
    """One warning per tensor type and kernel it lacks on device: which of the tensors that run, and what runs
    instead."""
    from moestream.kernels.types import FALLBACKS, fallbacks
    from moestream.models.registry import layout

    arch = layout(s.arch)
    experts = {n for il in s.expert_layers for n in arch.expert_tensor_names(il)}
    types = {name: t.qtype for name, t in f.tensors.items()}
    for (qtype, kernel), names in fallbacks(types, experts, device).items():
        where = "for experts computed on the CPU (--small-batch cpu)" if kernel == "CPU dot" else f"on {device}"
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        print(
            f"moestream: warning: {qtype.name} has no {kernel} {where}: {FALLBACKS[kernel]} "
            f"({len(names)} tensors: {listed})",
            file=sys.stderr,
        )


def check_info(a: argparse.Namespace) -> None:
    from moestream.options import Options

    check_model_path(a)
    if a.tokens is not None:
        at_least(a.tokens, 1, "--tokens")
        if not a.routing:
            raise MoestreamError(f"--tokens {a.tokens} is the prompt length of --routing: give --routing too")
    if a.text is not None:
        from moestream.tools.tokens import read_text

        if not a.routing:
            raise MoestreamError(f"--text {a.text} is the text of --routing: give --routing too")
        read_text(a.text)  # a bad file now, not after the report
    a.tokens = 2048 if a.tokens is None else a.tokens
    Options.check(device=a.device)  # a bad name now, not after the report


def cmd_info(a: argparse.Namespace) -> None:
    from moestream.formats.gguf import GGUFFile
    from moestream.models.describe import describe, expert_bytes_per_layer
    from moestream.options import Options

    tokens = a.tokens
    device = Options.make(device=a.device).model.device
    with GGUFFile(a.model) as f:
        stored = list(f.tensors.values())  # describe leaves out NextN blocks, which never run
        _, s = describe(f)
        if a.routing and tokens > s.n_ctx_train:
            raise MoestreamError(
                f"--tokens {tokens}: the model was trained for {s.n_ctx_train} positions; give at most {s.n_ctx_train}"
            )
        print(f"file          {f.path} ({format_size(f.path.stat().st_size)})")
        print(f"architecture  {s.arch}   name: {f.metadata.get('general.name', '?')}")
        kinds = [f"{s.n_layer_dense_lead} dense first"] if s.n_layer_dense_lead else []
        kinds += [f"{s.n_layer_nextn} NextN after them, skipped"] if s.n_layer_nextn else []
        kinds_note = f" ({', '.join(kinds)})" if kinds else ""
        print(
            f"layers        {s.n_layer}{kinds_note}   hidden {s.n_embd}   vocab {s.n_vocab}   context {s.n_ctx_train}"
        )
        print(f"attention     {s.n_head} heads / {s.n_head_kv} KV heads x {s.head_dim}   rope base {s.rope_base:g}")
        shared = f", a shared expert of FFN {s.n_ff_shexp}" if s.n_ff_shexp else ""
        print(f"experts       {s.n_expert}, {s.n_expert_used} used per token, FFN {s.n_ff_exp}{shared}")
        _print_types(f.metadata, stored)
        per_layer = expert_bytes_per_layer(f, s)
        print(
            f"expert bytes  {format_size(sum(per_layer))} total; per layer: "
            + " ".join(format_size(b) for b in per_layer[:8])
            + (" ..." if len(per_layer) > 8 else "")
        )
        print(f"other bytes   {format_size(sum(t.nbytes for t in f.tensors.values()) - sum(per_layer))}")
        _warn_fallbacks(f, s, device)
    if a.routing:
        from moestream.options import CACHE_POLICIES
        from moestream.runtime.loader import load
        from moestream.tools.cache_replay import cache_lines
        from moestream.tools.routing_stats import report_lines, report_tokens, routing_report

        engine = load(a.model, device=a.device, n_ctx=tokens)
        try:
            prompt, what = report_tokens(engine, a.text, tokens)
            r = routing_report(engine, prompt)
            print("\n".join(report_lines(r, s.n_expert_used, what)))
            print("\n".join(cache_lines(r.picks, s.n_expert, sum(per_layer), CACHE_POLICIES)))
        finally:
            engine.close()


def check_serve(a: argparse.Namespace) -> None:
    if not 0 < a.port < 65536:
        raise MoestreamError(f"--port {a.port}: expected 1 to 65535")
    at_least(a.max_seqs, 1, "--max-seqs")
    at_least(a.max_tokens, 1, "--max-tokens")
    at_least(a.cache_ram, -1, "--cache-ram")
    if a.threads_http != -1:
        at_least(a.threads_http, 1, "--threads-http")
    at_least(a.max_connections, 1, "--max-connections")
    for flag, seconds in (("--timeout", a.timeout), ("--shutdown-timeout", a.shutdown_timeout)):
        if not 0 <= seconds < 1e6:  # NaN too
            raise MoestreamError(f"{flag} {seconds}: give seconds, from 0 to 999999")
    if a.timeout <= 0:
        raise MoestreamError(f"--timeout {a.timeout}: give more than 0 seconds")
    from moestream.serving.guard import api_key_of  # no slow imports: the key is checked before the load

    a.api_key = api_key_of(a.api_key, a.api_key_file, os.environ)
    if a.alias is not None and not a.alias.strip():
        raise MoestreamError("-a is empty: give a model name, or leave the flag out to use the file's name")
    a.socket = _listening_socket(a.host, a.port)  # bound now: a port in use is said first, and no one takes it
    try:
        check_engine(a)
    except BaseException:
        a.socket.close()
        raise


def cmd_serve(a: argparse.Namespace) -> None:
    from moestream.runtime.loader import load
    from moestream.serving.app import create_app
    from moestream.serving.connections import server_config
    from moestream.serving.scheduler import Scheduler
    from moestream.serving.shutdown import GracefulServer, sigterm_raises

    with contextlib.closing(a.socket) as sock, sigterm_raises():
        engine = load(a.model, engine_options(a).replace(n_seqs=a.max_seqs))  # every sequence's KV budgeted
        try:
            if engine.tokenizer is None:
                raise MoestreamError(f"{a.model}: the file has no tokenizer; the server needs one to read prompts")
            ram = None if a.cache_ram < 0 else a.cache_ram << 20
            scheduler = Scheduler(engine, max_seqs=a.max_seqs, cache_prompt=a.cache_prompt, cache_ram=ram)
            try:
                name = a.alias or engine.source.path.name
                threads = None if a.threads_http == -1 else a.threads_http
                app = create_app(
                    scheduler,
                    name,
                    api_key=a.api_key,
                    max_tokens=a.max_tokens,
                    threads_http=threads,
                    reasoning_format=a.reasoning_format,
                )
                print(f"moestream: serving {name} on http://{a.host}:{a.port}/v1 (Ctrl-C stops)", file=sys.stderr)
                config = server_config(app, sock, a.timeout, a.max_connections, log_level="warning")
                server = GracefulServer(config, a.shutdown_timeout, end_streams=scheduler.stop)
                server.run(sockets=[sock])  # until Ctrl-C or SIGTERM, then drained (serving/shutdown.py)
                server.stopped()
            finally:
                scheduler.stop()
        finally:
            engine.close()  # host memory unpinned


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound here and handed to uvicorn, so no other process takes the port meanwhile."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise MoestreamError(
            f"--host {host}: {e.strerror}; give an address of this machine, such as 127.0.0.1"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise MoestreamError(f"--host {host} --port {port}: {e.strerror}; use another --port (or --host)") from None
    return sock


def check_make_model(a: argparse.Namespace) -> None:
    from moestream.tools.presets import get_preset
    from moestream.tools.recipes import recipe
    from moestream.tools.trained_routing import routing_settings

    recipe(a.quant)
    routing_settings(get_preset(a.preset, a.layers), a.routing)
    writable(a.out, "make-model")


def cmd_make_model(a: argparse.Namespace) -> None:
    from moestream.tools.presets import get_preset
    from moestream.tools.recipes import recipe
    from moestream.tools.synthetic import make_model
    from moestream.tools.trained_routing import routing_settings

    preset = get_preset(a.preset, a.layers)
    make_model(a.out, preset, quant=a.quant, seed=a.seed, routing=a.routing)
    routing = "trained" if routing_settings(preset, a.routing) else "uniform"
    layers = count_of(preset.spec.n_layer, "layer")
    print(f"wrote {a.out}: preset {preset.name}, {layers}, {recipe(a.quant).name}, {routing} routing")


# Each command: the check of every value (settling some into the namespace), run before torch is imported, so a
# bad value is answered at once; then the command itself.
COMMANDS = {
    "run": (check_run, cmd_run),
    "info": (check_info, cmd_info),
    "bench": (check_bench, cmd_bench),
    "profile": (check_profile, cmd_profile),
    "probe": (check_probe, cmd_probe),
    "make-model": (check_make_model, cmd_make_model),
    "serve": (check_serve, cmd_serve),
    "warmup": (check_warmup, cmd_warmup),
}


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"moestream: warning: {message}", file=sys.stderr)


# What each command is about to do, said on stderr as it starts (torch alone takes seconds to import).
STARTING = {
    "run": lambda a: (
        f"run: loading {a.model}, then generating "
        + ("until the end of text" if a.n_predict == -1 else count_of(a.n_predict, "token"))
    ),
    "info": lambda a: (
        f"info: reading {a.model}" + (f", then routing {count_of(a.tokens, 'token')}" if a.routing else "")
    ),
    "bench": lambda a: (
        f"bench: loading {a.model}, then {count_of(len(sweep_of(a).placements()), 'placement')} x "
        + count_of(sum(n > 0 for n in a.n_prompt + a.n_gen) * len(a.n_depth), "test")
        + f", {count_of(a.repetitions, 'repetition')} each"
    ),
    "profile": lambda a: (
        f"profile: loading {a.model}, then pp{a.n_prompt} under " + ", ".join(a.stream or ["serial", "overlap"])
    ),
    "probe": lambda a: "probe: timing this machine's link and expert GEMMs" + (f" for {a.model}" if a.model else ""),
    "make-model": lambda a: (
        f"make-model: writing {a.out} (preset {a.preset}"
        + (f", {count_of(a.layers, 'layer')}" if a.layers else "")
        + f", {a.quant})"
    ),
    "serve": lambda a: f"serve: loading {a.model} for http://{a.host}:{a.port}/v1",
    "warmup": lambda a: f"warmup: compiling the kernels a run of {a.model} with these flags needs",
}


# The slow third-party imports of each command (torch, numpy, gguf through the loader; the server's packages),
# done up front with Ctrl-C held back: an interrupt that lands inside an import leaves that module
# half-initialised (seen: numpy without `multiply`), and the command then dies of it with a traceback instead
# of stopping cleanly. The commands still import what they use; the slow part is loaded by then. (matplotlib,
# for `profile --plot` only, is not preloaded: it would cost every profile run its import.)
PRELOAD = {
    "serve": lambda a: ("moestream.runtime.loader", "moestream.serving.app", "uvicorn"),
    "make-model": lambda a: ("moestream.tools.synthetic",),
    # info reads the file without torch (models/describe.py) unless a GPU's kernels or --routing's model are asked
    "info": lambda a: (
        ("moestream.runtime.loader",)
        if a.routing or (a.device != "cpu" and driver_present())
        else ("moestream.models.describe",)
    ),
}


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C inside the block takes effect (as KeyboardInterrupt) when the block ends."""
    # only the main thread gets signals; a SIGINT that is ignored (a background job) or handled elsewhere stays so
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _one_line_warning
    try:
        args = build_parser().parse_args(argv)
        check, command = COMMANDS[args.command]
        check(args)
        print(f"moestream: {STARTING[args.command](args)}", file=sys.stderr, flush=True)  # before the slow imports
        with interrupts_held():
            for module in PRELOAD.get(args.command, lambda a: ("moestream.runtime.loader",))(args):
                importlib.import_module(module)
        command(args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"moestream: error: out of memory ({first}); lower --ctx or --ubatch, stream more layers "
            "(--n-cpu-moe, or --n-cpu-moe auto --vram-budget SIZE), or use fewer --slots",
            file=sys.stderr,
        )
        return 2
    except OSError as e:  # a file or socket the system refused: say which and why, in one line
        where = f"{e.filename}: " if e.filename else ""
        print(f"moestream: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoestream: interrupted", file=sys.stderr)  # the engine closed on the way out: memory unpinned
        return 130
    except Terminated:
        print("moestream: terminated", file=sys.stderr)
        return 143
    return 0


def entry() -> None:
    """The `moestream` command. After Ctrl-C, leave at once with 130: the engine is closed already, and an
    import that the interrupt cut short can fail again while the interpreter shuts down."""
    code = main()
    if code in (130, 143):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a closed pipe
                pass
        os._exit(code)
    sys.exit(code)
