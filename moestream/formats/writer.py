"""Write a GGUF file tensor by tensor, so a file bigger than RAM never has to sit in it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.quants import row_bytes


@dataclass(frozen=True)
class TensorPlan:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], row_bytes(self.qtype, self.shape[-1]))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, Sequence):  # a list, or a file's StringArray
        sub = (
            T.STRING
            if value and isinstance(value[0], str)
            else T.FLOAT32
            if value and isinstance(value[0], float)
            else T.INT32
        )
        w.add_key_value(key, list(value), T.ARRAY, sub_type=sub)
    else:
        raise TypeError(f"metadata {key}: cannot write a {type(value).__name__}")


Fill = Callable[[str, list[int], Callable[[int], None]], None]  # write_gguf_in_place's fill(part, offsets, done)


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: dict[str, Any],
    plans: list[TensorPlan],
    produce: Callable[[TensorPlan], np.ndarray],
    progress: bool = True,
) -> None:
    """Write metadata and tensor infos, then each tensor's bytes as produce(plan) returns them (uint8)."""

    def fill(part: str, offsets: list[int], done: Callable[[int], None]) -> None:
        with open(part, "r+b") as f:
            for p, offset in zip(plans, offsets, strict=True):
                data = produce(p)
                if data.dtype != np.uint8 or data.nbytes != p.nbytes:
                    raise ValueError(
                        f"{p.name}: produced {data.nbytes} bytes of {data.dtype}, expected {p.nbytes} uint8"
                    )
                f.seek(offset)
                data.tofile(f)
                done(p.nbytes)

    write_gguf_in_place(path, arch, metadata, plans, fill, progress)


def write_gguf_in_place(
    path: str | os.PathLike[str],
    arch: str,
    metadata: dict[str, Any],
    plans: list[TensorPlan],
    fill: Fill,
    progress: bool = True,
) -> None:
    """Write metadata and tensor infos into a file of the whole size (its padding zeros), then fill(part, offsets,
    done) writes each plan's bytes at its offset in the file named part, in any order and from any process,
    calling done(n) as n bytes land. The file appears at path only when whole: it is written beside it under
    another name, so a failure or Ctrl-C half-way leaves a file already there as it was."""
    path = os.fspath(path)
    part = f"{path}.{os.getpid()}.part"
    total = sum(p.nbytes for p in plans)
    where = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(where).free if os.path.isdir(where) else total  # no folder: open says so below
    if total > free:  # the file is sized up front, sparse: a full disk would show only hours later
        raise MoestreamError(
            f"{path}: the model takes {total / 2**30:.1f} GiB but {where} has {free / 2**30:.1f} GiB free; "
            "free some space or write it to another disk"
        )
    try:
        offsets = _layout(part, arch, metadata, plans)
        with tqdm(total=total, unit="B", unit_scale=True, desc="write", disable=not progress) as bar:
            fill(part, offsets, bar.update)
        os.replace(part, path)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise MoestreamError(f"{path}: the disk filled up while writing; free some space or write elsewhere") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


def _layout(path: str, arch: str, metadata: dict[str, Any], plans: list[TensorPlan]) -> list[int]:
    """Header, metadata and tensor infos written, the file sized to hold every tensor (each padded to the
    alignment, as gguf's writer pads them); returns where each tensor's bytes go."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if key != "general.architecture":
            _add_value(w, key, value)
    for p in plans:
        w.add_tensor_info(p.name, p.byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    align = w.data_alignment
    offset = gguf.GGUFWriter.ggml_pad(os.path.getsize(path), align)
    w.close()
    offsets = []
    for p in plans:
        offsets.append(offset)
        offset += gguf.GGUFWriter.ggml_pad(p.nbytes, align)
    os.truncate(path, offset)
    return offsets
