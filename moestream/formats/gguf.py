"""Open a GGUF file: metadata as plain Python values, every tensor as a zero-copy view of the memory map.

Nothing here reads tensor bytes; the map is paged in when a consumer touches a view.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from moestream.errors import MoestreamError
from moestream.formats.gguf_check import read_header
from moestream.formats.model_file import check_model_file

GGMLType = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TensorView:
    """One tensor of the file: its stored bytes (a view of the map) and its logical shape."""

    name: str
    qtype: GGMLType
    shape: tuple[int, ...]  # numpy order: a 2-D weight is [out, in], an expert stack [n_expert, out, in]
    data: np.ndarray  # uint8 view of the stored bytes, shape [..., row_bytes]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A memory-mapped GGUF file. Close it (or use it as a context manager) when done."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = check_model_file(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.tensors: dict[str, TensorView] = {}
        try:
            header = read_header(self.path, self._map)  # bounded counts and llama.cpp's layout rules
            self.metadata: dict[str, Any] = header.metadata
            data = np.frombuffer(self._map, dtype=np.uint8)
            for t in header.tensors:
                self.tensors[t.name] = TensorView(
                    name=t.name,
                    qtype=GGMLType(t.qtype),
                    shape=tuple(reversed(t.dims)),
                    data=_byte_view(data[t.start : t.start + t.nbytes], t.qtype, t.dims),
                )
        except BaseException:
            self.close()
            raise

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            what = "is missing" if arch is None else f"holds a value of type {type(arch).__name__}, not a name"
            raise MoestreamError(f"{self.path}: metadata key general.architecture {what}; convert the model again")
        return arch

    def tensor(self, name: str) -> TensorView:
        try:
            return self.tensors[name]
        except KeyError:
            raise MoestreamError(
                f"{self.path}: tensor {name} is missing; the file is incomplete or not a {self.architecture} model"
            ) from None

    def close(self) -> None:
        self.tensors.clear()
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps it when that view dies

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _byte_view(data: np.ndarray, qtype: GGMLType, dims: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored bytes as uint8 [..., row_bytes] without copying (dims in ggml order: the row first)."""
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return data.reshape(*reversed(dims[1:]), dims[0] // block * type_bytes)


def torch_bytes(view: TensorView):
    """The stored bytes as a CPU uint8 torch tensor sharing memory with the map (read-only: never write to it)."""
    return torch_bytes_of(view.data)


def torch_bytes_of(array: np.ndarray):
    """A numpy view of the map as a torch tensor without copying."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the read-only map is not writable
        return torch.from_numpy(array)
