"""Architectures moestream runs, keyed by GGUF `general.architecture`."""

from __future__ import annotations

from types import ModuleType

from moestream.errors import MoestreamError
from moestream.models import glm4moe, gpt_oss, qwen3moe, qwen35moe

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (qwen3moe, qwen35moe, gpt_oss, glm4moe)}


def architecture(name: str, path: object = "") -> ModuleType:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        where = f"{path}: " if path else ""
        raise MoestreamError(
            f"{where}architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
