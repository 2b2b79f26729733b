"""Flags shared by the commands and the checks that turn bad values into one clear line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream.cli.llama import LOAD_MODES, add_llama_flags, llama_notes
from moestream.errors import MoestreamError
from moestream.formats.model_file import check_model_file
from moestream.options import CACHE_POLICIES, Options, SmallBatch

LISTS = (
    "ubatch",
    "n_cpu_moe",
    "streamed_layers",
    "stream",
    "slots",
    "prefetch",
    "prefetch_ahead",
    "cpu_layers",
    "expert_cache",
    "cache_type_k",
    "cache_type_v",
)  # bench's


def engine_flags(p: argparse.ArgumentParser, lists: tuple[str, ...] = ()) -> None:
    """Flags shared by run, bench and profile; those named in lists (of LISTS) take comma lists."""

    def typed(dest: str, one, many, default):
        return (
            dict(type=many, default=[default] if default is not None else None)
            if dest in lists
            else dict(type=one, default=default)
        )

    more = "; bench: a comma list compares them" if lists == LISTS else ""
    p.add_argument("-m", "--model", required=True, help="path of a GGUF model file")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument(
        "-dev",
        "--devices",
        default=None,
        help="cuda:0,cuda:1,...: split each streamed layer's experts over these GPUs, each through its own link "
        "(expert parallel; the first also runs attention and the dense weights); cpu,cpu simulates it",
    )
    p.add_argument(
        "-ts",
        "--tensor-split",
        default=None,
        help="weights of the experts each of --devices gets, as llama.cpp: 3,1 (or 3/1); default even",
    )
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (default: bf16 on GPU, f32 on CPU)")
    p.add_argument(
        "-ub", "--ubatch", "--ubatch-size", **typed("ubatch", int, int_list, 512), help="prefill micro-batch size"
    )
    p.add_argument("-c", "--ctx", "--ctx-size", type=int, default=None, help="context size in tokens (default 4096)")
    for short, name, what in (("-ctk", "k", "keys"), ("-ctv", "v", "values")):
        p.add_argument(
            short,
            f"--cache-type-{name}",
            **typed(f"cache_type_{name}", str, _str_list, "auto"),
            metavar="TYPE",
            help=f"the KV cache's {what}: f32, f16, bf16, q8_0 or q4_0 (llama.cpp's blocks); default: --dtype" + more,
        )
    p.add_argument(
        "-ncmoe",
        "--n-cpu-moe",
        **typed("n_cpu_moe", ncmoe, _ncmoe_list, 0),
        help="keep the experts of the first N layers in host RAM and stream them; all or auto",
    )
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep every layer's experts in host RAM")
    p.add_argument(
        "--streamed-layers",
        **typed("streamed_layers", str, _str_list, "first"),
        help="which N layers stream: first (0..N-1, as llama.cpp) or spread (evenly spaced)",
    )
    p.add_argument("--vram-budget", default=None, help="cap on GPU memory, e.g. 12GiB (with -ncmoe auto: fit)")
    p.add_argument(
        "--stream",
        **typed("stream", str, _str_list, None),
        help="serial, pinned, overlap or layer-major (default: $MOESTREAM_STREAM or layer-major)",
    )
    p.add_argument("--slots", **typed("slots", int, int_list, 3), help="staging slots in the ring (>= 2)")
    p.add_argument(
        "--stream-min-batch",
        type=int,
        default=32,
        help="micro-batches smaller than this do not upload whole layers (see --small-batch)",
    )
    p.add_argument(
        "--keep-dequantized",
        action="store_true",
        help="layer-major prefill: dequantize a layer's experts once a prompt, not once a micro-batch (the "
        "workspace then holds the layer's three stacks: fewer layers fit a --vram-budget)",
    )
    p.add_argument(
        "--prefetch",
        **typed("prefetch", int, int_list, None),
        metavar="N",
        help="decode with --small-batch gather: fetch the N experts each gathered layer's router ranks first "
        "for the layer before's input while that layer runs, beside compute (0: off; default: as many as the "
        "router picks). A wrong guess costs link bytes, never a different answer" + more,
    )
    p.add_argument(
        "--prefetch-ahead",
        **typed("prefetch_ahead", int, int_list, 1),
        metavar="N",
        help="decode with --prefetch: guess each gathered layer's experts at the start of the streamed layer N "
        "before it (1, default, or 2: the link has two layers' compute to hide behind, the guess names somewhat "
        "fewer picks)" + more,
    )
    p.add_argument(
        "--cpu-layers",
        **typed("cpu_layers", int, int_list, 0),
        metavar="N",
        help="decode: N of the streamed layers (evenly spaced) compute a few tokens' experts on the CPU from the "
        "mapped file, inside the step's CUDA graph, while the others gather theirs over the link (default 0: "
        "none)" + more,
    )
    p.add_argument(
        "--expert-cache",
        **typed("expert_cache", _cache, _cache_list, None),
        metavar="N|auto",
        help="decode with --prefetch: keep the N most-picked experts of each streamed layer on the GPU, read there "
        "instead of over the link (0: off; default auto: as many as --vram-budget leaves, none without a budget; under "
        "serve, also the KV room its sequences do not hold: each holds its prompt and max_tokens)" + more,
    )
    p.add_argument(
        "--cache-policy",
        choices=CACHE_POLICIES,
        default="lru",
        help="which experts --expert-cache holds: static (most picked since load), lru (most recently picked) or "
        "lfu (most picked lately, decaying)",
    )
    p.add_argument(
        "--small-batch",
        default="auto",
        choices=[m.value for m in SmallBatch],
        help="below --stream-min-batch: upload only the chosen experts, gather them with a kernel reading "
        "page-locked host memory (no host sync; needs page-locking, so not with --stream serial), or compute "
        "them on the CPU; auto (default): on a GPU, whichever a few decode steps timed at load found fastest; "
        "on the CPU device, upload",
    )

    p.add_argument(
        "--host-memory",
        default=None,
        choices=("pinned", "pageable"),
        help="streamed experts: page-locked in place (pinned, default) or copied from the pageable map",
    )
    add_llama_flags(p)


def model_path(p: argparse.ArgumentParser, required: bool = True, what: str = "the GGUF model file") -> None:
    """A model file as a positional path or as -m (llama.cpp's spelling); check_model_path says if both are given."""
    p.add_argument("path", nargs="?", default=None, help=what)
    p.add_argument("-m", "--model", default=None, help=f"{what} (instead of the path)")
    p.set_defaults(model_required=required)


def check_model_path(a: argparse.Namespace) -> None:
    """a.model from the path or -m: one of them (or neither, where optional), not two."""
    if a.path is not None and a.model is not None:
        raise MoestreamError(f"{a.path} and -m {a.model}: give the model file once")
    a.model = a.model if a.model is not None else a.path
    if a.model is None and a.model_required:
        raise MoestreamError(f"`moestream {a.command}` needs a model file: give its path (or -m FILE)")
    if a.model is not None:
        check_model_file(a.model)


def ncmoe(text: str) -> int | str:
    return text if text in ("all", "auto") else _int(text)


def _cache(text: str) -> int | str:
    return text if text == "auto" else _int(text)


def _cache_list(text: str) -> list[int | str]:
    return [_cache(t) for t in text.split(",")]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's -l TOKEN(+|-)BIAS: 15043+1 raises token 15043's logit by 1, 15043-inf bans it."""
    token, sign, bias = text.partition("+") if "+" in text else text.partition("-")
    try:
        value = float(bias) * (-1 if sign == "-" else 1)
        if not sign or not token.strip().isdigit() or bias.strip().startswith(("+", "-")):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN_ID+BIAS or TOKEN_ID-BIAS (15043+1, 15043-inf: a ban), got {text!r}"
        ) from None
    return int(token), value


def int_list(text: str) -> list[int]:
    return [_int(t) for t in text.split(",")]


def _ncmoe_list(text: str) -> list[int | str]:
    return [ncmoe(t) for t in text.split(",")]


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",")]


def engine_flat(a: argparse.Namespace, ctx: int | None = None) -> dict:
    """The options every command shares, by flat name; list-valued flags (bench) give their first value here.
    ctx: the context when -c is not given (bench and profile size it to the test)."""

    def first(v):
        return v[0] if isinstance(v, list) else v

    given = a.n_cpu_moe if isinstance(a.n_cpu_moe, list) else [a.n_cpu_moe]
    if a.cpu_moe and given != [0] and set(given) != {"all"}:  # 0 is the default: not told apart from unset
        raise MoestreamError(
            f"--cpu-moe and --n-cpu-moe {','.join(map(str, given))} disagree: --cpu-moe keeps every layer's experts "
            "in host RAM (as -ncmoe all); use one of them"
        )
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
        keep_dequantized=a.keep_dequantized,
        streamed_layers=first(a.streamed_layers),
        small_batch=a.small_batch,
        prefetch=first(a.prefetch) if a.prefetch is not None else None,
        prefetch_ahead=first(a.prefetch_ahead),
        cpu_layers=first(a.cpu_layers),
        expert_cache=first(a.expert_cache) if a.expert_cache is not None else "auto",
        cache_policy=a.cache_policy,
        cache_type_k=first(a.cache_type_k),
        cache_type_v=first(a.cache_type_v),
        devices=a.devices,
        tensor_split=a.tensor_split.replace("/", ",") if a.tensor_split else None,
        threads=None if a.threads in (None, -1) else a.threads,  # llama.cpp's -t -1: the default
    )
    if a.batch_size is not None:
        at_least(a.batch_size, 1, "-b")
        opts["ubatch"] = min(opts["ubatch"], a.batch_size)  # as llama.cpp: a micro-batch fits in a batch
    if a.host_memory is not None and a.load_mode is not None and a.host_memory != LOAD_MODES[a.load_mode]:
        raise MoestreamError(f"-lm {a.load_mode} and --host-memory {a.host_memory} disagree; give one of them")
    host_memory = a.host_memory or LOAD_MODES.get(a.load_mode)
    if host_memory is not None:
        opts["host_memory"] = host_memory
    if a.ctx is not None or ctx is not None:
        opts["n_ctx"] = a.ctx if a.ctx is not None else ctx
    return opts


def check_engine(a: argparse.Namespace, ctx: int | None = None, rows: list[dict] = ()) -> None:
    """Every engine flag checked before torch is imported (rows: each bench row's changes, checked too), and the
    notes on llama.cpp flags said once."""
    check_model_file(a.model)
    flat = engine_flat(a, ctx)
    for row in rows or [{}]:
        Options.check(**flat | row)
    for note in llama_notes(a):
        print(f"moestream: note: {note}", file=sys.stderr)


def engine_options(a: argparse.Namespace, ctx: int | None = None) -> Options:
    """The options every command shares, settled (torch imported): check_engine has said what is wrong."""
    return Options.make(**engine_flat(a, ctx))


def writable(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when an output path cannot be written."""
    if path is None:
        return
    if not path.strip():  # Path('') is '.', which would read as "is a directory"
        raise MoestreamError(f"{flag}: the path is empty; give a file name")
    p = Path(path)
    if p.is_dir():
        raise MoestreamError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise MoestreamError(f"{flag} {path}: the folder {p.parent} does not exist")
    try:  # open it as the run will, without touching what is there
        if p.exists():
            open(p, "ab").close()
        else:
            open(p, "xb").close()
            p.unlink()
    except OSError as e:
        raise MoestreamError(f"{flag} {path}: cannot be written ({e.strerror or e}); give another path") from None


def at_least(value: int, least: int, flag: str) -> None:
    if value < least:
        raise MoestreamError(f"{flag} {value}: must be at least {least}")
