"""What each tensor type has of its kernels on a device, so that a fallback is visible (`info` names it). The CPU's
answer comes from the type registry alone; a GPU's imports its kernel modules (torch, Triton) when first asked."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from moestream.formats import quants

if TYPE_CHECKING:
    import torch

# Each kernel a type may lack, and what runs instead
FALLBACKS = {
    "Triton dequant tile": "the torch reference dequantizes them for prefill",
    "decode block dot": "decode dequantizes them, then multiplies",
    "CPU dot": "they are dequantized in torch, then multiplied",
}


def missing(qtype: GGMLQuantizationType, device: torch.device | str) -> list[str]:
    """The kernels (FALLBACKS' names) qtype lacks on device (a CUDA or the CPU device). A type formats/quants
    does not know cannot be read at all: quants.get's error says so."""
    entry = quants.get(qtype)
    if _kind(device) == "cpu":
        return [] if entry.cpu_dot else ["CPU dot"]  # the C kernel (kernels/cpu_quant.py) has every named block
    from moestream.kernels import dequant, dots  # what Triton compiles here (none without it)

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
    gpu = _kind(device) == "cuda"
    for name, qtype in types.items():
        if qtype in FLOATS:
            continue
        lacks = (missing(qtype, device) if gpu else []) + (missing(qtype, "cpu") if name in experts else [])
        for kernel in lacks:
            out.setdefault((qtype, kernel), []).append(name)
    return out


def _kind(device: torch.device | str) -> str:
    """cpu or cuda, as torch.device(device).type says, without importing torch."""
    return str(device).partition(":")[0]
