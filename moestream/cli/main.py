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
import warnings
from collections import Counter

from moestream.cli.args import LISTS, OWN_DEFAULT, at_least, engine_flags, engine_options, int_list, writable
from moestream.cli.perf import cmd_bench, cmd_probe, cmd_profile
from moestream.errors import MoestreamError, is_out_of_memory


class _Parser(argparse.ArgumentParser):
    """Flag errors in one line, as every other bad input (not argparse's usage block first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A word of a dash and a digit is a value (--vram-budget -1G, --temp -1e-3), not an unknown flag, so the
        # flag's own check names its range. argparse takes only -5 and -.5 so ("expected one argument" for the
        # rest); no flag here starts with a digit. Subcommands are made of this class too.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        self.exit(2, f"moestream: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add = sub.add_parser
    sub.add_parser = lambda *a, **k: _add(*a, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **k)

    run = sub.add_parser("run", help="generate text from a prompt")
    engine_flags(run)
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
    info.add_argument(
        "--tokens", type=int, default=None, help="prompt length for --routing (default 2048)" + OWN_DEFAULT
    )
    info.add_argument("--device", default="auto")

    bench = sub.add_parser("bench", help="prefill/decode tokens/s per placement and schedule, against the floors")
    engine_flags(bench, lists=LISTS)
    bench.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths, e.g. 512,2048")
    bench.add_argument("-n", "--n-gen", type=int_list, default=[0], help="decode lengths (0: prefill only)")
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--no-floors", action="store_true", help="skip the all-resident compute-floor runs")
    bench.add_argument(
        "-o",
        "--output",
        default="md",
        choices=("md", "json", "csv", "jsonl"),
        help="md (a table, printed as rows finish), json, csv or jsonl: llama-bench's field names, then ours",
    )
    bench.add_argument("--json", action="store_true", help="the same as -o json")

    prof = sub.add_parser("profile", help="timeline of one prefill pass per schedule: idle %%, link GB/s, overlap")
    engine_flags(prof, lists=("stream",))
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

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests")
    serve.add_argument("--max-seqs", type=int, default=4, help="sequences served at once (the rest queue)")
    serve.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask")

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

    if not a.prompt:
        raise MoestreamError("-p: the prompt is empty; give some text")
    at_least(a.n_predict, 0, "-n")
    params = SamplingParams(max_tokens=a.n_predict, temperature=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed)

    prompt: list[int] = []  # encoded once, before the weights load

    def prompt_fits(tokenizer, n_ctx: int, _spec) -> None:
        if tokenizer is None:
            raise MoestreamError(f"{a.model}: the file has no tokenizer, so it cannot read a text prompt")
        prompt.extend(tokenizer.encode_prompt(a.prompt, a.chat))
        if (n := len(prompt)) > n_ctx:
            raise MoestreamError(
                f"the prompt is {n} tokens but the context is {n_ctx} (--ctx, at most what the model was trained "
                "for); raise --ctx or shorten the prompt"
            )

    engine = load(a.model, engine_options(a), before_weights=prompt_fits)
    if str(engine.source.metadata.get("general.name", "")).startswith("moestream-generated"):
        print(
            "moestream: note: this model has random weights (moestream make-model): expect gibberish", file=sys.stderr
        )
    try:
        gen = engine.generate(prompt, params, on_text=lambda s: print(s, end="", flush=True))
    except KeyboardInterrupt as e:  # say what was done before the interrupt, then exit 130
        gen = getattr(e, "generation", None)
        if gen is not None:
            print()
            _print_stats(gen)
        raise
    finally:
        engine.close()
    print()
    _print_stats(gen)


def _print_stats(gen) -> None:
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
    from moestream.options import Options
    from moestream.runtime.loader import describe, expert_bytes_per_layer

    tokens = 2048 if a.tokens is None else a.tokens
    at_least(tokens, 1, "--tokens")
    if a.tokens is not None and not a.routing:
        raise MoestreamError(f"--tokens {a.tokens} is the prompt length of --routing: give --routing too")
    if a.device != "auto":
        if not a.routing:
            raise MoestreamError(f"--device {a.device} runs --routing's prompt: give --routing too")
        Options.make(device=a.device)  # a bad name now, not after the report
    with GGUFFile(a.model) as f:
        _, s = describe(f)
        if a.routing and tokens > s.n_ctx_train:
            raise MoestreamError(
                f"--tokens {tokens}: the model was trained for {s.n_ctx_train} positions; give at most {s.n_ctx_train}"
            )
        print(f"file          {f.path} ({_size(f.path.stat().st_size)})")
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
        from moestream.runtime.loader import load
        from moestream.tools.routing import routing_load

        engine = load(a.model, device=a.device, n_ctx=tokens)
        try:
            counter = routing_load(engine, tokens)
        finally:
            engine.close()
        print(f"routing on {tokens} random tokens: per layer min / mean / max load, max/mean, idle experts")
        for il in s.expert_layers:  # a dense layer routes nothing
            row, ratio = counter.counts[il], counter.imbalance()[il]
            idle = int((row == 0).sum())
            print(
                f"  layer {il:3d}  {int(row.min()):6d} {row.float().mean():8.1f} {int(row.max()):6d}"
                f"   {float(ratio):4.2f}x   {idle} idle"
            )


def cmd_serve(a: argparse.Namespace) -> None:
    import uvicorn

    from moestream.runtime.loader import load
    from moestream.serving.app import create_app
    from moestream.serving.scheduler import Scheduler

    if not 0 < a.port < 65536:
        raise MoestreamError(f"--port {a.port}: expected 1 to 65535")
    at_least(a.max_seqs, 1, "--max-seqs")
    at_least(a.max_tokens, 1, "--max-tokens")
    if a.api_key is not None and not a.api_key.strip():
        raise MoestreamError("--api-key is empty: give a key, or leave the flag out to serve without one")
    with contextlib.closing(_listening_socket(a.host, a.port)) as sock:  # before the load: a port in use is said
        engine = load(a.model, engine_options(a).replace(n_seqs=a.max_seqs))  # every sequence's KV budgeted
        try:
            if engine.tokenizer is None:
                raise MoestreamError(f"{a.model}: the file has no tokenizer; the server needs one to read prompts")
            scheduler = Scheduler(engine, max_seqs=a.max_seqs)
            try:
                name = engine.source.path.name
                app = create_app(scheduler, name, api_key=a.api_key, max_tokens=a.max_tokens)
                print(f"moestream: serving {name} on http://{a.host}:{a.port}/v1 (Ctrl-C stops)", file=sys.stderr)
                uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])  # Ctrl-C: drains
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


def cmd_make_model(a: argparse.Namespace) -> None:
    from moestream.tools.presets import get_preset
    from moestream.tools.synthetic import make_model

    preset = get_preset(a.preset, a.layers)
    writable(a.out, "make-model")
    make_model(a.out, preset, quant=a.quant, seed=a.seed)
    print(f"wrote {a.out}: preset {preset.name}, {preset.spec.n_layer} layers, {a.quant}")


COMMANDS = {
    "run": cmd_run,
    "info": cmd_info,
    "bench": cmd_bench,
    "profile": cmd_profile,
    "probe": cmd_probe,
    "make-model": cmd_make_model,
    "serve": cmd_serve,
}


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"moestream: warning: {message}", file=sys.stderr)


# The slow third-party imports of each command (torch, numpy, gguf through the loader; the server's packages),
# done up front with Ctrl-C held back: an interrupt that lands inside an import leaves that module
# half-initialised (seen: numpy without `multiply`), and the command then dies of it with a traceback instead
# of stopping cleanly. The commands still import what they use; the slow part is loaded by then. (matplotlib,
# for `profile --plot` only, is not preloaded: it would cost every profile run its import.)
PRELOAD = {
    "serve": ("moestream.runtime.loader", "moestream.serving.app", "uvicorn"),
    "make-model": ("moestream.tools.synthetic",),
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
        with interrupts_held():
            for module in PRELOAD.get(args.command, ("moestream.runtime.loader",)):
                importlib.import_module(module)
        COMMANDS[args.command](args)
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
    return 0


def entry() -> None:
    """The `moestream` command. After Ctrl-C, leave at once with 130: the engine is closed already, and an
    import that the interrupt cut short can fail again while the interpreter shuts down."""
    code = main()
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a closed pipe
                pass
        os._exit(130)
    sys.exit(code)
