"""Walk a GGUF header with every count bounded by the bytes left, before anything allocates by it.

The `gguf` reader trusts the counts it reads (a metadata array declared 2^40 long makes it build a list of
that length), and accepts tensor data that overlaps, leaves gaps or sits off the alignment. This walk checks
what llama.cpp's loader checks (`gguf.cpp`): known value and tensor types, at most 4 dimensions, rows whole
blocks, names under 64 bytes, no duplicates, a power-of-two alignment, and tensor data back to back in the
order of the tensor infos, each padded to the alignment, inside the file.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moestream.errors import MoestreamError

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
STRING, ARRAY = 8, 9
MAX_DIMS, MAX_NAME = 4, 64
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

    def value(self, key: str, vtype: int):
        if vtype == STRING:
            return self.string(f"metadata {key}")
        if vtype == ARRAY:
            etype = self.take("<I")
            if etype == ARRAY or (etype != STRING and etype not in SCALAR_SIZES):
                raise self.fail(f"metadata array {key} has element type {etype}, which GGUF does not define here")
            n = self.count(f"metadata array {key}", 8 if etype == STRING else SCALAR_SIZES[etype])
            if etype == STRING:
                for _ in range(n):
                    length = self.count(f"metadata array {key} (a string)", 1)
                    self.pos += length
            else:
                self.pos += n * SCALAR_SIZES[etype]
            return None
        if vtype not in SCALAR_SIZES:
            raise self.fail(f"metadata {key} has value type {vtype}, which GGUF does not define")
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        return self.take(fmt[vtype])


def check_gguf(path: Path) -> None:
    """Raise a MoestreamError naming the first problem of the header or the data layout, if any."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise MoestreamError(f"{path}: only {size} bytes, too short for a GGUF header; {FIX}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(_Walker(path, buf))


def _walk(w: _Walker) -> None:
    w.take("<4s")
    version = w.take("<I")
    if version not in (2, 3):
        raise MoestreamError(f"{w.path}: GGUF version {version} is not supported (2 and 3 are); convert it again")
    n_tensors = w.count("the tensor count", 8 + 4 + 8 + 4 + 8)
    n_kv = w.count("the metadata count", 8 + 4 + 1)
    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for _ in range(n_kv):
        key = w.string("a metadata key")
        if key in keys:
            raise w.fail(f"metadata key {key} appears twice")
        keys.add(key)
        vtype = w.take("<I")
        value = w.value(key, vtype)
        if key == "general.alignment":
            if vtype != 4 or value == 0 or value & (value - 1):
                raise w.fail(f"general.alignment = {value!r} must be a power of two stored as uint32")
            alignment = value
    infos, names = [], set()
    for _ in range(n_tensors):
        name = w.string("a tensor name")
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
            raise w.fail(f"tensor {name} has dimensions {dims}: each must be at least 1")
        if dims[0] % block:
            raise w.fail(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        n = 1
        for d in dims:
            n *= d
        infos.append((name, offset, n // block * type_size))
    data_start = -(-w.pos // alignment) * alignment
    expected = 0
    for name, offset, nbytes in infos:
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
