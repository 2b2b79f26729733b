"""Generated models: random weights with the exact names, shapes, metadata and quant mix of a real file.

Weights are scaled so the residual stream stays dominated by each token's own embedding; the router then
sees distinct inputs per token and spreads them over all experts the way a trained router does.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np
import torch

from moestream.errors import MoestreamError
from moestream.formats.quantize import quantize
from moestream.formats.tokenizer import tiny_tokenizer_metadata
from moestream.formats.writer import TensorPlan, write_gguf
from moestream.models.presets import Preset
from moestream.models.registry import architecture

Q = gguf.GGMLQuantizationType
QUANTS = ("F32", "BF16", "Q8_0", "Q4_K_M")
FILE_TYPES = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_K_M": 15}  # llama.cpp's general.file_type codes
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # rows not a multiple of 256, as llama.cpp does


def preset_metadata(p: Preset, quant: str) -> dict[str, Any]:
    """General keys, the architecture's `{arch}.*` keys and a test tokenizer."""
    meta: dict[str, Any] = {
        "general.architecture": p.arch,
        "general.name": f"moestream-generated {p.name}",
        "general.file_type": FILE_TYPES[quant],
        "general.quantization_version": 2,
    }
    return meta | architecture(p.arch).metadata(p) | tiny_tokenizer_metadata(p.n_vocab)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], quant: str, n_layer: int) -> Q:
    """The type a llama.cpp quantization of this preset gives the tensor."""
    # the converter keeps routers, shared-expert gates, convolutions and non-weights (ssm_a, ssm_dt) in F32
    if (len(shape) == 1 or not name.endswith(".weight") or "ffn_gate_inp" in name or "ssm_conv1d" in name
            or quant == "F32"):
        return Q.F32
    if quant == "BF16":
        return Q.BF16
    if quant == "Q8_0":
        qtype = Q.Q8_0
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


def _float_tensor(name: str, shape: tuple[int, ...], n_layer: int, seed: int) -> np.ndarray:
    # crc32, not hash(): Python salts hash() per process
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) % 1_000_003)
    if name.endswith(".ssm_a"):  # -exp(A_log): decay rates from slow to fast, as transformers initialises A
        return -torch.empty(shape).uniform_(0.01, 16, generator=g).numpy()
    if len(shape) == 1:  # norm weights and dt bias: near one
        return (1.0 + 0.05 * torch.randn(shape, generator=g)).numpy()
    return (init_std(name, shape, n_layer) * torch.randn(shape, generator=g)).numpy()


def _quantize_parallel(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Quantize along the first axis in threads (numpy releases the GIL on big arrays)."""
    workers = min(os.cpu_count() or 1, 16)
    if x.ndim < 2 or x.shape[0] < 2 or x.size < 1 << 22 or workers == 1:
        return quantize(x, qtype)
    parts = np.array_split(x, min(workers, x.shape[0]), axis=0)
    with ThreadPoolExecutor(workers) as pool:
        return np.concatenate(list(pool.map(lambda part: quantize(part, qtype), parts)), axis=0)


def make_model(out: str | os.PathLike[str], preset: Preset, quant: str = "Q4_K_M", seed: int = 0,
               progress: bool = True) -> None:
    """Write a generated model of the preset to `out`, one tensor at a time."""
    if quant not in QUANTS:
        raise MoestreamError(f"--quant {quant}: choose from {', '.join(QUANTS)}")
    arch = architecture(preset.arch)
    meta = preset_metadata(preset, quant)
    spec = arch.read_spec(meta, preset.n_vocab)  # the spec a reader of the file will see
    shapes = arch.tensor_shapes(spec, tied_output=preset.tied_output)
    plans = [TensorPlan(n, tensor_type(n, s, quant, preset.n_layer), s) for n, s in shapes.items()]

    def produce(p: TensorPlan) -> np.ndarray:
        return _quantize_parallel(_float_tensor(p.name, p.shape, preset.n_layer, seed), p.qtype)

    write_gguf(out, preset.arch, meta, plans, produce, progress)
