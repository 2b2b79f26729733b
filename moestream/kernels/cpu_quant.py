"""Quantized matvec on the CPU, a small C file compiled on first use for this machine; the types it serves are
those formats/quants names a C block function (`cpu_dot`) for.

For the experts a small batch chose that live in host RAM: the CPU reads the stored blocks where they lie
(the memory-mapped file) and multiplies in float32 over OpenMP threads, with no dequantized copy, instead of
moving the weights to the GPU. The build goes to the user's cache folder, keyed by the source's hash; without
a C compiler the callers fall back to dequantizing in torch (one warning says so).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import GGMLQuantizationType as Q

from moestream.errors import MoestreamError
from moestream.formats import quants
from moestream.formats.quants import grids
from moestream.kernels import compiles

PARALLEL_WEIGHTS = 1 << 20  # below this many products, threads cost more than they save (a busy machine's
# threads wait for each other at the end of each call); every output is one thread's either way: the same bits
SOURCE = Path(__file__).with_name("csrc") / "cpu_quant.c"
TYPES = frozenset(t.qtype for t in quants.TYPES.values() if t.cpu_dot)
INT8_TYPES = frozenset(  # cpu_quant.c's int8_offset
    {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4}
)


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


# The grids cpu_quant.c reads, by their C names (IQ1_M reads IQ1_S's)
_C_GRIDS = {
    "IQ2XXS_GRID": Q.IQ2_XXS,
    "IQ2XS_GRID": Q.IQ2_XS,
    "IQ2S_GRID": Q.IQ2_S,
    "IQ3XXS_GRID": Q.IQ3_XXS,
    "IQ3S_GRID": Q.IQ3_S,
    "IQ1S_GRID": Q.IQ1_S,
}


def grid_header() -> str:
    """iq_grids.h, which cpu_quant.c includes: the IQ grids and the 7-bit sign patterns as C tables, from
    formats/quants/grids.py (which has them from gguf)."""
    lines = []
    for name, qtype in _C_GRIDS.items():
        v = grids.grid_values(qtype).astype(int)
        rows = ",".join("{" + ",".join(map(str, row)) + "}" for row in v)
        ctype = "int8_t" if v.min() < 0 else "uint8_t"
        lines.append(f"static const {ctype} {name}[{len(v)}][{v.shape[1]}] = {{{rows}}};")
    lines.append(f"static const uint8_t KSIGNS[128] = {{{','.join(map(str, grids.KSIGNS))}}};")
    return "\n".join(lines) + "\n"


_lock = threading.Lock()  # one build, whichever thread asks first (build_in_background's or a caller's)
_loaded: dict[str, ctypes.CDLL | None] = {}


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _built()
        return _loaded["lib"]


def _built() -> ctypes.CDLL | None:
    header = grid_header().encode()
    key = SOURCE.read_bytes() + header + _cpu_flags()  # -march=native: a build is only good for this kind of CPU
    lib = compiles.c_cache_dir() / f"cpu_quant-{hashlib.sha256(key).hexdigest()[:16]}.so"
    try:
        return _build_and_load(lib, header)
    except OSError as e:  # an unwritable cache folder, a build that cannot load...
        with contextlib.suppress(OSError):
            lib.unlink(missing_ok=True)  # a build that does not load is not kept for the next run
        warnings.warn(f"the CPU matvec is unavailable ({e}); dequantizing in torch instead", stacklevel=3)
        return None


def _build_and_load(lib: Path, header: bytes) -> ctypes.CDLL | None:
    if not lib.exists():
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            warnings.warn("no C compiler found: CPU expert matvecs dequantize in torch instead (slower)", stacklevel=3)
            return None
        lib.parent.mkdir(parents=True, exist_ok=True)
        compiles.compiling()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # built aside, then moved: no half-written .so
            out = Path(tmp) / lib.name
            (Path(tmp) / "iq_grids.h").write_bytes(header)
            cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-I", tmp, str(SOURCE)]
            cmd += ["-o", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                first = (r.stderr.strip().splitlines() or ["?"])[0]
                warnings.warn(f"building the CPU matvec failed ({first}); dequantizing in torch instead", stacklevel=3)
                return None
            os.replace(out, lib)
        compiles.compiled(time.perf_counter() - start, "the C matvec")
    dll = ctypes.CDLL(str(lib))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    head = [p, ctypes.c_int, i64, i64, i64, p, i64]  # weights, type, n_out, n_in, row bytes, matrices, picks
    dll.matvec_picked.restype = dll.matvec_picked_int8.restype = dll.int8_offset.restype = ctypes.c_int
    dll.matvec_picked.argtypes = head + [p, p, ctypes.c_int]
    dll.matvec_picked_int8.argtypes = head + [p, p, p, p, p, ctypes.c_int]
    dll.quantize_x.argtypes = [p, i64, p, p, p, p]
    dll.int8_offset.argtypes = [ctypes.c_int]
    dll.host_swiglu.argtypes, dll.host_swiglu.restype = [p], None
    return dll


def available() -> bool:
    return _library() is not None


def build_in_background() -> None:
    """Start building (or loading) the C matvec on a thread of its own: a fresh machine's compile takes seconds,
    which then overlap the model's load; available() waits for it."""
    threading.Thread(target=available, name="moestream-cpu-matvec", daemon=True).start()


def matvec(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    n_out: int,
    x: torch.Tensor,
    mats: torch.Tensor | None = None,
    int8: bool = False,
) -> torch.Tensor:
    """y [P, n_out] float32 = W_p x[p] for each row p of x [P, in]; raw holds the stored bytes of one matrix
    [n_out, ...] (mats None) or a stack [E, n_out, ...] indexed by mats [P] (CPU tensors). With int8, x is
    rounded to int8 a 32 values first and the products are integer (llama.cpp's CPU experts do the same; about
    3x the rate, ~0.5% relative error a dot) where the type and a row length of 256s allow."""
    lib = _library()
    if lib is None:
        raise MoestreamError("the compiled CPU matvec is unavailable here (see the warning given when it failed)")
    block, type_size = GGML_QUANT_SIZES[qtype]
    x = x.detach().to(torch.float32).contiguous()
    P, n_in = x.shape
    raw = raw.contiguous()  # a view of the map stays a view
    if (
        n_in % block
        or raw.shape[-1] != n_in // block * type_size
        or raw.shape[-2] != n_out
        or raw.dim() != 2 + (mats is not None)
    ):
        raise ValueError(f"CPU matvec: stored bytes {list(raw.shape)} do not hold {n_out} rows of {n_in} {qtype.name}")
    if mats is not None:
        mats = mats.to(torch.int64).contiguous()
        if mats.numel() and not (0 <= int(mats.min()) and int(mats.max()) < raw.shape[0]):
            raise IndexError("matrix index out of range")
    y = torch.empty((P, n_out), dtype=torch.float32)
    head = (raw.data_ptr(), int(qtype), n_out, n_in, n_in // block * type_size)
    head += (mats.data_ptr() if mats is not None else None, P)
    threads = torch.get_num_threads() if P * n_out * n_in >= PARALLEL_WEIGHTS else 1
    if int8 and n_in % 256 == 0 and qtype in INT8_TYPES:
        xq = torch.empty((P, n_in), dtype=torch.int8)
        dx, xqs, xs = (
            torch.empty((P, n_in // n), dtype=d)
            for n, d in ((32, torch.float32), (16, torch.int32), (16, torch.float32))
        )
        lib.quantize_x(x.data_ptr(), P * n_in, xq.data_ptr(), dx.data_ptr(), xqs.data_ptr(), xs.data_ptr())
        err = lib.matvec_picked_int8(
            *head, xq.data_ptr(), dx.data_ptr(), xqs.data_ptr(), xs.data_ptr(), y.data_ptr(), threads
        )
    else:
        err = lib.matvec_picked(*head, x.data_ptr(), y.data_ptr(), threads)
    if err:
        raise ValueError(f"CPU matvec: type {qtype.name} is not supported")
    return y
