"""Open a GGUF file: metadata as plain Python values, every tensor as a zero-copy view of the memory map.

Nothing here reads tensor bytes; the map is paged in when a consumer touches a view.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from moestream.errors import MoestreamError
from moestream.formats.gguf_check import check_gguf

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
        if not os.fspath(path):  # Path("") is ".", a directory
            raise MoestreamError("the model path is empty; pass the path of a .gguf model file")
        self.path = Path(path)
        if not self.path.is_file():
            if self.path.is_dir():
                what = "is a directory"
            elif self.path.exists():
                what = "is not a regular file (a pipe or device cannot be memory-mapped)"
            else:
                what = "no such file"
            shown = str(self.path) if str(self.path).strip() == str(self.path) else repr(str(self.path))  # ' '
            raise MoestreamError(f"{shown}: {what}; pass the path of a .gguf model file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise MoestreamError(
                f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                "convert the model with llama.cpp's convert_hf_to_gguf.py or pass a .gguf file"
            )
        check_gguf(self.path)  # bounded counts and llama.cpp's layout rules, before gguf allocates by them
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise MoestreamError(
                f"{self.path}: the GGUF header is damaged or truncated ({e}); download or convert the file again"
            ) from None
        self.metadata: dict[str, Any] = {
            name: _field_value(field) for name, field in self._reader.fields.items() if not name.startswith("GGUF.")
        }
        self.tensors: dict[str, TensorView] = {}
        try:
            self._index_tensors()
        except BaseException:
            self.close()
            raise

    def _index_tensors(self) -> None:  # check_gguf has already placed every tensor inside the file
        for t in self._reader.tensors:
            self.tensors[t.name] = TensorView(
                name=t.name,
                qtype=GGMLType(int(t.tensor_type)),
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                data=_byte_view(t),
            )

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise MoestreamError(f"{self.path}: metadata key general.architecture is missing")
        return arch

    @property
    def mmap(self) -> np.memmap:
        """The whole file as one uint8 map (what the offload layer page-locks)."""
        return self._reader.data

    def tensor(self, name: str) -> TensorView:
        try:
            return self.tensors[name]
        except KeyError:
            raise MoestreamError(
                f"{self.path}: tensor {name} is missing; the file is incomplete or not a {self.architecture} model"
            ) from None

    def close(self) -> None:
        mm = getattr(self._reader.data, "_mmap", None)
        self.tensors.clear()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the OS unmaps it when that view dies

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _field_value(field: gguf.ReaderField) -> Any:
    """A metadata value as Python: str, int, float, bool or a list of them."""
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        # numeric arrays: one contiguous part holds every element
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return field.contents()


def _byte_view(t: gguf.ReaderTensor) -> np.ndarray:
    """The stored bytes as uint8 [..., row_bytes] without copying."""
    data = t.data
    flat = data.reshape(-1).view(np.uint8)
    n_cols = int(t.shape[0])
    block, type_bytes = gguf.GGML_QUANT_SIZES[GGMLType(int(t.tensor_type))]
    row_bytes = n_cols // block * type_bytes
    rows = tuple(int(d) for d in reversed(t.shape[1:].tolist()))
    return flat.reshape(*rows, row_bytes)


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
