"""Flags shared by the commands and the checks that turn bad values into one clear line."""

from __future__ import annotations

import argparse
from pathlib import Path

from moestream.errors import MoestreamError


def engine_flags(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Flags shared by run, bench and profile; with lists=True the numeric ones take comma lists."""
    num = int_list if lists else int
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
        default="auto",
        choices=("auto", "upload", "gather", "cpu"),
        help="below --stream-min-batch: upload only the chosen experts, gather them with a kernel reading "
        "page-locked host memory (no host sync; needs page-locking, so not with --stream serial), or compute "
        "them on the CPU; auto (default): gather where a GPU can read the page-locked experts, else upload",
    )


def _ncmoe(text: str) -> int | str:
    return text if text in ("all", "auto") else _int(text)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_list(text: str) -> list[int]:
    return [_int(t) for t in text.split(",")]


def _ncmoe_list(text: str) -> list[int | str]:
    return [_ncmoe(t) for t in text.split(",")]


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",")]


def engine_options(a: argparse.Namespace) -> dict:
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


def writable(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when an output path cannot be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise MoestreamError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise MoestreamError(f"{flag} {path}: the folder {p.parent} does not exist")


def at_least(value: int, least: int, flag: str) -> None:
    if value < least:
        raise MoestreamError(f"{flag} {value}: must be at least {least}")
