"""One GGUF tensor type as a plug-in: its block layout, its torch reference dequant, and the names of the
kernels that serve it where they exist. The names are looked up in kernels/ (formats does not import kernels),
so this entry is the one place that says what a type has. The entry itself needs no torch: its reference is
found in its family's module on first use, so what a file holds and which kernels serve it read in a blink."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorType:
    qtype: GGMLQuantizationType
    family: str  # the module of formats/quants with its torch reference (REFERENCES[qtype]), imported when used
    tile: str | None = None  # kernels/dequant.py: the Triton tile that dequantizes its blocks on the GPU
    dot: str | None = None  # kernels/dots.py: the block dot of the decode matvec
    cpu_dot: str | None = None  # kernels/csrc/cpu_quant.c: the C function expanding a block for the CPU matvec

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block(self) -> int:
        """Elements a block holds."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        """Bytes a block takes."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def reference(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """(n, type_size) uint8 blocks -> (n, block) float32."""
        return self._module().REFERENCES[self.qtype]

    @property
    def table(self) -> Callable[[torch.device], torch.Tensor] | None:
        """The small int32 lookup table (a grid) its tile and dot read, made once per device (the family's
        kernel_table); None: they read none."""
        make = getattr(self._module(), "kernel_table", None)
        return None if make is None else functools.partial(make, self.qtype)

    def _module(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.family}")


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one stored row of n_cols elements (any GGML type, supported or not)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise MoestreamError(f"a row of {n_cols} is not a whole number of {qtype.name} blocks of {block}")
    return n_cols // block * type_size
