"""Generated models: random weights with the exact names, shapes, metadata and quant mix of a real file.

Weights are scaled so the residual stream stays dominated by each token's own embedding; the router then
sees distinct inputs per token and spreads them over all experts the way a trained router does.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from moestream.errors import MoestreamError
from moestream.formats.quantize import QUANTIZABLE, quantize
from moestream.formats.tokenizer import UNUSED, tiny_tokenizer_metadata
from moestream.formats.writer import TensorPlan, write_gguf_in_place
from moestream.models.registry import layout
from moestream.models.spec import Preset
from moestream.tools.recipes import Facts, Recipe, recipe, tensor_types
from moestream.tools.trained_routing import RoutingSettings, planted, routing_settings, trained_std

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def preset_metadata(p: Preset, r: Recipe, seed: int = 0, trained: bool = False) -> dict[str, Any]:
    """General keys (what made the file among them), the architecture's `{arch}.*` keys and a test tokenizer."""
    meta: dict[str, Any] = {
        "general.architecture": p.spec.arch,
        "general.name": f"moestream-generated {p.name}",
        "general.description": description(p, r, seed, trained),
        "general.file_type": int(r.file_type),
        "general.quantization_version": 2,
    }
    return meta | layout(p.spec.arch).metadata(p) | tiny_tokenizer_metadata(p.spec.n_vocab, p.chat)


def description(p: Preset, r: Recipe, seed: int, trained: bool = False) -> str:
    """How the file was made: a reader must not take its blocks for a real quantization's."""
    text = f"moestream make-model: random weights (preset {p.name}, seed {seed})"
    if trained:
        text += " planted to route like a trained model's (--routing trained)"
    if not r.quantized:
        return f"{text}, stored in {r.name}"
    imatrix = " (as with an importance matrix, which llama.cpp requires for it)" if r.imatrix else ""
    return (
        f"{text}; the tensor types of llama.cpp's {r.name} recipe{imatrix}; blocks from moestream's quick "
        "quantizer (min/max scales, nearest grid points), no importance matrix"
    )


def init_std(name: str, shape: tuple[int, ...], n_layer: int) -> float:
    """Standard deviation of a weight: unit-scale projections, residual branches damped by depth."""
    fan_in = shape[-1]
    if name == "token_embd.weight":
        return 1.0
    if "attn_output" in name or "ffn_down" in name or "ssm_out" in name:
        return 0.5 / (fan_in * 2 * n_layer) ** 0.5
    return 1.0 / fan_in**0.5


CHUNK_ELEMENTS = 1 << 22  # generation unit: fixed, so a file does not depend on the number of workers


@dataclass(frozen=True)
class Planting:
    """What trained routing plants (make-model --routing trained): the preset and its settings."""

    preset: Preset
    settings: RoutingSettings


def _float_rows(
    name: str,
    shape: tuple[int, ...],
    n_layer: int,
    seed: int,
    part: int,
    n_rows: int,
    real: int | None = None,
    plant: Planting | None = None,
) -> np.ndarray:
    """Rows [part * chunk, part * chunk + n_rows) of the tensor, flattened to [n_rows, shape[-1]]. real: the
    output head's real tokens (the rest pad the vocabulary to the embedding's size). plant: trained routing's
    structures (None: uniform routing)."""
    # crc32, not hash(): Python salts hash() per process
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), part])
    size = (n_rows, shape[-1])
    if name.endswith(".ssm_a"):  # -exp(A_log): decay rates from slow to fast, as transformers initialises A
        rows = -rng.uniform(0.01, 16, size).astype(np.float32)
    elif name.endswith(".bias") or "attn_sinks" in name:  # biases and gpt-oss's sinks: around zero
        rows = rng.standard_normal(size, dtype=np.float32)
    elif len(shape) == 1:  # norm weights: near one
        rows = (1.0 + 0.05 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
    else:
        std = init_std(name, shape, n_layer)
        if plant is not None:
            std = trained_std(name, shape[-1], plant.settings) or std
        rows = std * rng.standard_normal(size, dtype=np.float32)
        if real is not None:  # the head favours real tokens, so greedy text (and most samples) can be read: a
            # padding token's logit is 0, a real one's about N(0, 16), still random
            first = part * max(1, CHUNK_ELEMENTS // shape[-1])
            rows *= np.where(np.arange(first, first + n_rows) < real, 4.0, 0.0).astype(np.float32)[:, None]
    return rows if plant is None else _plant(name, rows, part, shape, seed, plant)


def _plant(name: str, rows: np.ndarray, part: int, shape: tuple[int, ...], seed: int, plant: Planting) -> np.ndarray:
    first = part * max(1, CHUNK_ELEMENTS // shape[-1])
    return planted(name, rows, first, plant.preset, plant.settings, seed)


@dataclass(frozen=True)
class Chunk:
    """Rows [part * step, part * step + n_rows) of one tensor, made and written by one call in a worker."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    n_layer: int
    seed: int
    part: int
    n_rows: int
    at: int  # the chunk's first byte within its tensor's
    real: int | None = None  # the output head's real tokens
    plant: Planting | None = None


def _write_chunk(c: Chunk, path: str, offset: int) -> int:
    """Make the chunk and write it at offset in the file being written; returns its bytes."""
    rows = _float_rows(c.name, c.shape, c.n_layer, c.seed, c.part, c.n_rows, c.real, c.plant)
    data = memoryview(quantize(rows, c.qtype)).cast("B")
    fd = os.open(path, os.O_WRONLY)
    try:
        written = 0
        while written < len(data):  # a regular file takes it whole, but pwrite may stop short of a large one
            written += os.pwrite(fd, data[written:], offset + written)
    finally:
        os.close(fd)
    return written


def _chunks(p: TensorPlan, n_layer: int, seed: int, real: int | None = None, plant: Planting | None = None) -> list:
    n_rows = int(np.prod(p.shape[:-1]))
    step = max(1, CHUNK_ELEMENTS // p.shape[-1])
    row = p.byte_shape[-1]
    return [
        Chunk(p.name, p.shape, p.qtype, n_layer, seed, k, min(step, n_rows - start), start * row, real, plant)
        for k, start in enumerate(range(0, n_rows, step))
    ]


def tensor_plans(preset: Preset, r: Recipe) -> list[TensorPlan]:
    """Each tensor of the preset's file, in the type the recipe gives it, in file order."""
    arch = layout(preset.spec.arch)
    spec = arch.read_spec(preset_metadata(preset, r), preset.spec.n_vocab)  # the spec a reader of the file sees
    shapes = {
        n: s
        for n, s in arch.tensor_shapes(spec, tied_output=preset.tied_output).items()
        if not (n.startswith("blk.") and n.split(".", 2)[2] in preset.omitted)  # what llama.cpp also sees
    }
    types = tensor_types(shapes, r, Facts.of(spec, shapes))
    return [TensorPlan(n, types[n], s) for n, s in shapes.items()]


def make_model(
    out: str | os.PathLike[str],
    preset: Preset,
    quant: str = "Q4_K_M",
    seed: int = 0,
    progress: bool = True,
    routing: str | None = None,
) -> None:
    """Write a generated model of the preset to `out` in a llama.cpp recipe (--quant), one tensor at a time.
    routing: trained (weights planted to route like a trained model's), uniform (plain random weights) or None
    (trained where the preset has settings for it)."""
    r = recipe(quant)
    if seed < 0:
        raise MoestreamError(f"--seed {seed}: give a seed of 0 or more")
    settings = routing_settings(preset, routing)
    plant = None if settings is None else Planting(preset, settings)
    plans = tensor_plans(preset, r)
    if lacking := sorted({p.qtype.name for p in plans if p.qtype not in QUANTIZABLE}):
        raise MoestreamError(
            f"--quant {r.name}: moestream cannot write {', '.join(lacking)} blocks yet (no "
            f"quantizer for that type); choose another recipe"
        )
    meta = preset_metadata(preset, r, seed, trained=plant is not None)

    types_of_tokens = meta["tokenizer.ggml.token_type"]
    real = types_of_tokens.index(UNUSED) if UNUSED in types_of_tokens else None  # padding follows the real ones
    workers = min(os.cpu_count() or 1, 32)
    chunks = [  # in file order
        c
        for p in plans
        for c in _chunks(p, preset.spec.n_layer, seed, real if p.name == "output.weight" else None, plant)
    ]
    # big files: worker processes generate, quantize and write chunks in place (numpy holds the GIL too often
    # for threads; bytes sent back to this process made it the bottleneck)
    pool = _worker_pool(workers) if workers > 1 and len(chunks) > len(plans) else None

    def fill(part: str, offsets: list[int], done: Callable[[int], None]) -> None:
        start = dict(zip((p.name for p in plans), offsets, strict=True))
        jobs = [(c, part, start[c.name] + c.at) for c in chunks]
        if pool is None:
            for job in jobs:
                done(_write_chunk(*job))
            return
        pending: deque = deque()  # up to 4 chunks a worker in flight: bounded memory, workers never idle
        for job in jobs:
            if len(pending) >= 4 * workers:
                done(pending.popleft().get())
            pending.append(pool.apply_async(_write_chunk, job))
        while pending:
            done(pending.popleft().get())

    finished = False
    try:
        write_gguf_in_place(out, preset.spec.arch, meta, plans, fill, progress)
        finished = True
    finally:
        if pool is not None:
            pool.close() if finished else pool.terminate()  # Ctrl-C or an error: the chunks in flight are not needed
            pool.join()


def _worker_pool(workers: int) -> mp.pool.Pool:
    """Worker processes that leave Ctrl-C to this one (it stops them: else each prints its own traceback) and
    die with it. SIGINT is blocked while they fork, so none is born able to take it; a worker forked later (the
    pool replaces one that dies) comes from the pool's own thread, which keeps that mask."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return mp.get_context("fork").Pool(workers, initializer=_worker_start, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C that came meanwhile is delivered now


def _worker_start(parent: int) -> None:
    # one BLAS thread a worker: there is a worker a core, and each worker's own BLAS threads (a core's count each,
    # numpy's default) only contend with the other workers (the bytes are the same)
    threadpool_limits(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # killed when the process that forked it ends, however it ends: a worker ignores Ctrl-C, and its siblings
    # hold its task pipe open, so nothing else would end one left behind
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent:
        os._exit(1)  # no death signal, or the parent is already gone
