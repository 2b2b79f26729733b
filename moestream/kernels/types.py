"""What each tensor type has of its kernels on a device, so that a fallback is visible (`info` names it)."""

from __future__ import annotations

from collections.abc import Collection

import torch
from gguf import GGMLQuantizationType

from moestream.formats import quants
from moestream.kernels import cpu_quant, dequant, dots

# Each kernel a type may lack, and what runs instead
FALLBACKS = {
    "Triton dequant tile": "the torch reference dequantizes them for prefill",
    "decode block dot": "decode dequantizes them, then multiplies",
    "CPU dot": "they are dequantized in torch, then multiplied",
}


def missing(qtype: GGMLQuantizationType, device: torch.device | str) -> list[str]:
    """The kernels (FALLBACKS' names) qtype lacks on device (a CUDA or the CPU device). A type formats/quants
    does not know cannot be read at all: quants.get's error says so."""
    quants.get(qtype)
    if torch.device(device).type == "cpu":
        return [] if qtype in cpu_quant.TYPES else ["CPU dot"]
    lacks = [] if qtype in dequant.TILES else ["Triton dequant tile"]
    return lacks + ([] if qtype in dots.DOTS or qtype in dots.FLOAT_DOTS else ["decode block dot"])


FLOATS = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def fallbacks(
    types: dict[str, GGMLQuantizationType], experts: Collection[str], device: torch.device | str
) -> dict[tuple[GGMLQuantizationType, str], list[str]]:
    """A model's tensors (name -> type) that would not get their fast path on device, by (type, kernel lacked).
    On a GPU each block-quantized tensor wants its tile and dot; expert stacks (`experts`) also the CPU dot,
    for experts computed on the host. Float types lack nothing: dequantizing one is a cast."""
    out: dict[tuple[GGMLQuantizationType, str], list[str]] = {}
    gpu = torch.device(device).type == "cuda"
    for name, qtype in types.items():
        if qtype in FLOATS:
            continue
        lacks = (missing(qtype, device) if gpu else []) + (missing(qtype, "cpu") if name in experts else [])
        for kernel in lacks:
            out.setdefault((qtype, kernel), []).append(name)
    return out
