"""What each tensor type has of its kernels on a device, so that a fallback is visible (`info` names it)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from moestream.formats import quants
from moestream.kernels import cpu_quant, dequant, dots

# Each kernel a type may lack, and what runs instead
FALLBACKS = {
    "Triton dequant tile": "the torch reference dequantizes",
    "decode block dot": "dequantized, then multiplied",
    "CPU dot": "dequantized in torch, then multiplied",
}


def missing(qtype: GGMLQuantizationType, device: torch.device | str) -> list[str]:
    """The kernels (FALLBACKS' names) qtype lacks on device (a CUDA or the CPU device). A type formats/quants
    does not know cannot be read at all: quants.get's error says so."""
    quants.get(qtype)
    if torch.device(device).type == "cpu":
        return [] if qtype in cpu_quant.TYPES else ["CPU dot"]
    lacks = [] if qtype in dequant.TILES else ["Triton dequant tile"]
    return lacks + ([] if qtype in dots.DOTS or qtype in dots.FLOAT_DOTS else ["decode block dot"])
