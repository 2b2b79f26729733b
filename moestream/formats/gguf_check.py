"""Read a GGUF header in one walk with every count bounded by the bytes left, before anything allocates by it.

The `gguf` reader trusts the counts it reads (a metadata array declared 2^40 long makes it build a list of
that length), accepts tensor data that overlaps, leaves gaps or sits off the alignment, and parses string
arrays in Python objects one by one (a 152k-token vocabulary took seconds). This walk checks what llama.cpp's
loader checks (`gguf.cpp`): known value and tensor types, at most 4 dimensions, rows whole blocks, names under
64 bytes, no duplicates, a power-of-two alignment, and tensor data back to back in the order of the tensor
infos, each padded to the alignment, inside the file. A string array stays in the map, decoded on access.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DIMS, MAX_NAME = 4, 64
METADATA_PREFIXES = ("general.", "tokenizer.")
DEFAULT_ALIGNMENT = 32
FIX = "the file is damaged; download or convert it again"


class _Walker:
    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, what: str) -> MoestreamError:
        return MoestreamError(f"{self.path}: {what}; {FIX}")

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.fail(f"the header ends early (byte {self.pos} of {self.size})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, what: str, min_bytes_each: int) -> int:
        """A u64 count, bounded by the bytes left in the file."""
        n = self.take("<Q")
        left = self.size - self.pos
        if n * min_bytes_each > left:
            raise self.fail(f"{what} declares {n} entries but only {left} bytes remain")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"{what} (a string)", 1)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def strings(self, key: str, n: int) -> StringArray:
        """n length-prefixed strings: bounded like count(), in a tight loop (a vocabulary has 100k+)."""
        buf, pos, size, length_at = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        bounds = [0] * (2 * n)
        for i in range(n):
            if pos + 8 > size:
                raise self.fail(f"the header ends early (byte {pos} of {size})")
            (length,) = length_at(buf, pos)
            if length > size - pos - 8:
                raise self.fail(
                    f"metadata array {key} (a string) declares {length} entries but only {size - pos - 8} bytes remain"
                )
            bounds[2 * i], pos = pos + 8, pos + 8 + length
            bounds[2 * i + 1] = pos
        first = bounds[0] if n else pos
        self.pos = pos
        return StringArray(bytes(buf[first:pos]), np.array(bounds, dtype=np.int64).reshape(n, 2) - first)

    def value(self, key: str, vtype: int):
        if vtype == STRING:
            return self.string(f"metadata {key}")
        if vtype == ARRAY:
            etype = self.take("<I")
            if etype == ARRAY or (etype != STRING and etype not in SCALAR_SIZES):
                raise self.fail(f"metadata array {key} has element type {etype}, which GGUF does not define here")
            n = self.count(f"metadata array {key}", 8 if etype == STRING else SCALAR_SIZES[etype])
            if etype == STRING:
                return self.strings(key, n)
            values = np.frombuffer(self.buf, "<" + SCALAR_FORMATS[etype], n, self.pos).tolist()
            self.pos += n * SCALAR_SIZES[etype]
            return values
        if vtype not in SCALAR_SIZES:
            raise self.fail(f"metadata {key} has value type {vtype}, which GGUF does not define")
        return self.take("<" + SCALAR_FORMATS[vtype])


class StringArray(Sequence[str]):
    """A metadata array of strings kept as one block of bytes, each decoded when read (a vocabulary is read whole
    only by the tokenizer)."""

    def __init__(self, blob: bytes, bounds: np.ndarray):
        self.blob, self.bounds = blob, bounds  # bounds [n, 2]: each string's start and end in blob

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start, end = self.bounds[i].tolist()
        return self.blob[start:end].decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        blob = self.blob
        for start, end in zip(self.bounds[:, 0].tolist(), self.bounds[:, 1].tolist(), strict=True):  # flat lists
            yield blob[start:end].decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: its type, its dimensions (ggml order: the row first) and its byte range."""

    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]
    start: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


def read_header(path: Path, buf) -> Header:
    """The metadata and tensor infos of the GGUF file in buf (its map), or a MoestreamError naming the first
    problem of the header or the data layout."""
    if len(buf) < 24:
        raise MoestreamError(f"{path}: only {len(buf)} bytes, too short for a GGUF header; {FIX}")
    return _walk(_Walker(path, buf))


def _walk(w: _Walker) -> Header:
    w.take("<4s")
    version = w.take("<I")
    if version not in (2, 3):
        raise MoestreamError(f"{w.path}: GGUF version {version} is not supported (2 and 3 are); convert it again")
    n_tensors = w.count("the tensor count", 8 + 4 + 8 + 4 + 8)
    n_kv = w.count("the metadata count", 8 + 4 + 1)
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = w.string("a metadata key")
        if key in metadata:
            raise w.fail(f"metadata key {key} appears twice")
        vtype = w.take("<I")
        value = metadata[key] = w.value(key, vtype)
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise w.fail(f"general.alignment = {value!r} must be a power of two stored as uint32")
            alignment = value
    infos, names = [], set()
    for _ in range(n_tensors):
        name = w.string("a tensor name")
        if name.startswith(METADATA_PREFIXES):  # tensors are token_embd.weight, blk.0.attn_q.weight, ...
            raise w.fail(
                f"a tensor info is named {name!r}, a metadata key: the header's metadata count ({n_kv}) is lower "
                "than the metadata it holds"
            )
        if len(name.encode()) >= MAX_NAME or name in names:
            why = "appears twice" if name in names else f"is {len(name.encode())} bytes (at most {MAX_NAME - 1})"
            raise w.fail(f"tensor name {name[:80]!r} {why}")
        names.add(name)
        n_dims = w.take("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise w.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [w.take("<Q") for _ in range(n_dims)]
        ttype = w.take("<I")
        offset = w.take("<Q")
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise w.fail(f"tensor {name} has type id {ttype}, which ggml does not define") from None
        if min(dims) < 1 or max(dims) >= 2**62:
            raise w.fail(f"tensor {name} has dimensions {dims}: each must be from 1 to 2^62 - 1")
        if dims[0] % block:
            raise w.fail(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        n = 1
        for d in dims:
            n *= d
        infos.append((name, qtype, tuple(dims), offset, n // block * type_size))
    data_start = -(-w.pos // alignment) * alignment
    if any(w.buf[w.pos : min(data_start, w.size)]):  # writers pad with zeros: else the counts miss an entry
        raise w.fail(
            f"the bytes from {w.pos} to the tensor data at {data_start} are not zero padding: the header's tensor "
            f"count ({n_tensors}) is lower than the tensor infos it holds"
        )
    expected = 0
    tensors = []
    for name, qtype, dims, offset, nbytes in infos:
        if offset != expected:
            raise w.fail(
                f"tensor {name} starts at data offset {offset}, expected {expected} (tensor data must follow the "
                f"tensor infos back to back, each padded to {alignment} bytes)"
            )
        if data_start + offset + nbytes > w.size:
            raise MoestreamError(
                f"{w.path}: truncated: tensor {name} ends at byte {data_start + offset + nbytes} but the file has "
                f"{w.size} bytes; the download or conversion did not finish, fetch the file again"
            )
        expected += -(-nbytes // alignment) * alignment
        tensors.append(TensorInfo(name, qtype, dims, data_start + offset, nbytes))
    unread = w.size - (data_start + expected)
    if unread >= alignment:
        warnings.warn(
            f"{w.path}: {unread} bytes follow the last tensor's data that no tensor info names; the header's "
            f"tensor count ({n_tensors}) may be lower than the tensors the file holds (a damaged file)",
            stacklevel=3,
        )
    return Header(metadata, tensors)
