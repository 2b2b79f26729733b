"""Generated models: random weights with the exact names, shapes, metadata and quant mix of a real file.

Weights are scaled so the residual stream stays dominated by each token's own embedding; the router then
sees distinct inputs per token and spreads them over all experts the way a trained router does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import zlib
from collections import deque
from typing import Any

import gguf
import numpy as np

from moestream.errors import MoestreamError
from moestream.formats.quantize import quantize
from moestream.formats.tokenizer import tiny_tokenizer_metadata
from moestream.formats.writer import TensorPlan, write_gguf
from moestream.models.registry import architecture
from moestream.models.spec import Preset

Q = gguf.GGMLQuantizationType
QUANTS = ("F32", "BF16", "Q8_0", "Q4_K_M", "MXFP4_MOE")
FILE_TYPES = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_K_M": 15, "MXFP4_MOE": 38}  # llama.cpp's general.file_type codes
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # rows not a multiple of 256, as llama.cpp does


def preset_metadata(p: Preset, quant: str) -> dict[str, Any]:
    """General keys, the architecture's `{arch}.*` keys and a test tokenizer."""
    meta: dict[str, Any] = {
        "general.architecture": p.spec.arch,
        "general.name": f"moestream-generated {p.name}",
        "general.file_type": FILE_TYPES[quant],
        "general.quantization_version": 2,
    }
    return meta | architecture(p.spec.arch).metadata(p) | tiny_tokenizer_metadata(p.spec.n_vocab, p.chat)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], quant: str, n_layer: int) -> Q:
    """The type a llama.cpp quantization of this preset gives the tensor."""
    # the converter keeps routers, shared-expert gates, convolutions and non-weights (ssm_a, ssm_dt) in F32
    if (
        len(shape) == 1
        or not name.endswith(".weight")
        or "ffn_gate_inp" in name
        or "ssm_conv1d" in name
        or quant == "F32"
    ):
        return Q.F32
    if quant == "BF16":
        return Q.BF16
    if quant == "Q8_0":
        qtype = Q.Q8_0
    elif quant == "MXFP4_MOE":  # gpt-oss's published mix: expert stacks MXFP4, other matrices Q8_0
        qtype = Q.MXFP4 if len(shape) == 3 else Q.Q8_0
    else:  # Q4_K_M
        il = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more = il >= 0 and _use_more_bits(il, n_layer)
        if name == "output.weight" or (more and ("attn_v." in name or "ffn_down" in name)):
            qtype = Q.Q6_K
        elif "attn_qkv." in name:
            qtype = Q.Q5_K
        else:
            qtype = Q.Q4_K
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        qtype = FALLBACK.get(qtype, qtype)
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = Q.F16
    return qtype


def init_std(name: str, shape: tuple[int, ...], n_layer: int) -> float:
    """Standard deviation of a weight: unit-scale projections, residual branches damped by depth."""
    fan_in = shape[-1]
    if name == "token_embd.weight":
        return 1.0
    if "attn_output" in name or "ffn_down" in name or "ssm_out" in name:
        return 0.5 / (fan_in * 2 * n_layer) ** 0.5
    return 1.0 / fan_in**0.5


CHUNK_ELEMENTS = 1 << 22  # generation unit: fixed, so a file does not depend on the number of workers


def _float_rows(name: str, shape: tuple[int, ...], n_layer: int, seed: int, part: int, n_rows: int) -> np.ndarray:
    """Rows [part * chunk, part * chunk + n_rows) of the tensor, flattened to [n_rows, shape[-1]]."""
    # crc32, not hash(): Python salts hash() per process
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), part])
    size = (n_rows, shape[-1])
    if name.endswith(".ssm_a"):  # -exp(A_log): decay rates from slow to fast, as transformers initialises A
        return -rng.uniform(0.01, 16, size).astype(np.float32)
    if name.endswith(".bias") or "attn_sinks" in name:  # biases and gpt-oss's sinks: around zero
        return rng.standard_normal(size, dtype=np.float32)
    if len(shape) == 1:  # norm weights and dt bias: near one
        return (1.0 + 0.05 * rng.standard_normal(size, dtype=np.float32)).astype(np.float32)
    return init_std(name, shape, n_layer) * rng.standard_normal(size, dtype=np.float32)


def _make_chunk(task: tuple) -> np.ndarray:
    name, shape, qtype, n_layer, seed, part, n_rows = task
    return quantize(_float_rows(name, shape, n_layer, seed, part, n_rows), qtype)


def _chunks(p: TensorPlan, n_layer: int, seed: int) -> list[tuple]:
    n_rows = int(np.prod(p.shape[:-1]))
    step = max(1, CHUNK_ELEMENTS // p.shape[-1])
    return [
        (p.name, p.shape, p.qtype, n_layer, seed, k, min(step, n_rows - start))
        for k, start in enumerate(range(0, n_rows, step))
    ]


def make_model(
    out: str | os.PathLike[str], preset: Preset, quant: str = "Q4_K_M", seed: int = 0, progress: bool = True
) -> None:
    """Write a generated model of the preset to `out`, one tensor at a time."""
    if quant not in QUANTS:
        raise MoestreamError(f"--quant {quant}: choose from {', '.join(QUANTS)}")
    if seed < 0:
        raise MoestreamError(f"--seed {seed}: give a seed of 0 or more")
    arch = architecture(preset.spec.arch)
    meta = preset_metadata(preset, quant)
    spec = arch.read_spec(meta, preset.spec.n_vocab)  # the spec a reader of the file will see
    shapes = arch.tensor_shapes(spec, tied_output=preset.tied_output)
    plans = [TensorPlan(n, tensor_type(n, s, quant, preset.spec.n_layer), s) for n, s in shapes.items()]

    tasks = {p.name: _chunks(p, preset.spec.n_layer, seed) for p in plans}
    workers = min(os.cpu_count() or 1, 32)
    # big files: worker processes generate and quantize chunks (numpy holds the GIL too often for threads)
    many = workers > 1 and max(map(len, tasks.values())) > 1
    pool = mp.get_context("fork").Pool(workers, initializer=_leave_interrupts) if many else None
    queued = iter([t for p in plans for t in tasks[p.name]])  # every chunk, in file order
    pending: deque = deque()  # chunks the workers are making, oldest first

    def produce(p: TensorPlan) -> np.ndarray:
        """The tensor's chunks; meanwhile the workers run up to 4 chunks each ahead, across tensor boundaries,
        so they keep working while this process writes (bounded: a few MiB per worker)."""
        if pool is None:
            return np.concatenate([_make_chunk(t) for t in tasks[p.name]]).reshape(p.byte_shape)
        parts = []
        for _ in tasks[p.name]:
            while len(pending) < 4 * workers and (t := next(queued, None)) is not None:
                pending.append(pool.apply_async(_make_chunk, (t,)))
            parts.append(pending.popleft().get())
        return np.concatenate(parts).reshape(p.byte_shape)

    done = False
    try:
        write_gguf(out, preset.spec.arch, meta, plans, produce, progress)
        done = True
    finally:
        if pool is not None:
            pool.close() if done else pool.terminate()  # Ctrl-C or an error: the chunks in flight are not needed
            pool.join()


def _leave_interrupts() -> None:
    """A worker ignores Ctrl-C: the writing process stops them (else each prints its own traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
