"""A streamed layer's routed experts computed on the CPU as a step of the GPU's stream (`--small-batch cpu`).

The GPU copies x, the picks and their weights to page-locked buffers, a CUDA host function (cpu_quant.c's
host_swiglu, queued with the driver's cuLaunchHostFunc) runs the experts from the mapped file with integer
dots, and the GPU copies the result back: no host sync, so a decode step with experts on the CPU is captured
and replayed as one CUDA graph like the others. SwiGLU experts, or gpt-oss's clamped GLU with its biases
(the pairs' biases are copied over with x). Buffers are kept per shape; each layer's weights get their own
argument block.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from moestream.kernels import cpu_quant

_P = ctypes.c_void_p


class _Args(ctypes.Structure):  # cpu_quant.c's host_swiglu_args, field for field
    _fields_ = [
        ("w", _P * 3),
        ("qtype", ctypes.c_int64 * 3),
        ("row_bytes", ctypes.c_int64 * 3),
        *((name, ctypes.c_int64) for name in ("n_embd", "n_ff", "n_tokens", "n_used", "n_threads")),
        *((name, _P) for name in ("x", "ids", "weights", "out", "gu", "down", "xq", "dx", "xs", "xqs")),
        *((name, _P) for name in ("gate_b", "up_b", "down_b")),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


@cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuLaunchHostFunc.argtypes = [_P, _P, _P]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    return lib


def usable(qtypes, device: torch.device) -> bool:
    """Whether experts of these types can run as a host function in device's stream."""
    return (
        device.type == "cuda"
        and all(q in cpu_quant.TYPES for q in qtypes)
        and cpu_quant.available()
        and _driver() is not None
    )


class Buffers:
    """Page-locked in and out buffers (pinned where a GPU copies them) and the C code's scratch for T tokens
    of K picks, D hidden, F expert width."""

    def __init__(self, T: int, K: int, D: int, F: int, pin: bool):
        def host(shape, dtype):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.queued = pin  # run as a host function in a GPU's stream (else called here, on the CPU device)

        n = max(T * D, T * K * F)  # x's rows, then the picks' hidden rows, quantized
        self.x, self.out = host((T, D), torch.float32), host((T, D), torch.float32)
        self.ids, self.weights = host((T, K), torch.int64), host((T, K), torch.float32)
        self.gu, self.down = torch.empty(T * K, 2 * F), torch.empty(T * K, D)
        self.xq, self.dx = torch.empty(n, dtype=torch.int8), torch.empty(n // 32)
        self.xs, self.xqs = torch.empty(n // 16), torch.empty(n // 16, dtype=torch.int32)
        self.gate_b, self.up_b = host((T * K, F), torch.float32), host((T * K, F), torch.float32)
        self.down_b = host((T * K, D), torch.float32)
        self.args: dict[tuple, _Args] = {}

    def args_for(self, raws, qtypes, T: int, K: int, D: int, F: int, clamped: tuple | None) -> _Args:
        """The argument block for one layer's stacks (kept: a captured graph holds its address)."""
        glu = None if clamped is None else tuple(clamped[3:])  # alpha, limit
        key = (*((r.data_ptr(), int(q), r.shape[-1]) for r, q in zip(raws, qtypes, strict=True)), glu)  # all it holds
        if key not in self.args:
            a = _Args()
            for i, (raw, q) in enumerate(zip(raws, qtypes, strict=True)):
                a.w[i], a.qtype[i], a.row_bytes[i] = raw.data_ptr(), int(q), raw.shape[-1]
            a.n_embd, a.n_ff, a.n_tokens, a.n_used, a.n_threads = D, F, T, K, threads(self.queued)
            names = ["x", "ids", "weights", "out", "gu", "down", "xq", "dx", "xs", "xqs"]
            if glu is not None:
                names += ["gate_b", "up_b", "down_b"]
                a.alpha, a.limit = glu
            for name in names:
                setattr(a, name, getattr(self, name).data_ptr())
            self.args[key] = a
        return self.args[key]


def threads(queued: bool) -> int:
    """host_swiglu's OpenMP threads: torch's count, one fewer in a GPU's stream, where the thread waiting for
    that stream spins on a core meanwhile (CUDA's wait while cores outnumber contexts), and each parallel loop
    would wait for whichever of its threads is descheduled."""
    n = torch.get_num_threads()
    return max(1, n - 1) if queued else n


_buffers: dict[tuple, Buffers] = {}


def _buffers_for(T: int, K: int, D: int, F: int, pin: bool) -> Buffers:
    key = (T, K, D, F, pin)
    if key not in _buffers:
        _buffers[key] = Buffers(*key)
    return _buffers[key]


def swiglu(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, raws, qtypes, clamped: tuple | None = None
) -> torch.Tensor:
    """Sum over each token's picked experts of weight * down(silu(gate(x)) * up(x)) (with clamped, the fields
    of ops/moe_swiglu.ClampedGlu: gpt-oss's GLU and the pairs' biases), from the stored stacks raws (gate, up
    [E, F, bytes], down [E, D, bytes], host memory). x [T, D] on a GPU: queued on its current stream, the
    result on that device in x's dtype; on the CPU: run now."""
    (T, D), K, F = x.shape, ids.shape[1], raws[0].shape[1]
    b = _buffers_for(T, K, D, F, x.is_cuda)
    args = b.args_for(raws, qtypes, T, K, D, F, clamped)
    lib = cpu_quant._library()
    copies = [(b.x, x), (b.ids, ids), (b.weights, weights)]
    if clamped is not None:
        copies += list(zip((b.gate_b, b.up_b, b.down_b), clamped[:3], strict=True))
    for dst, src in copies:
        dst.copy_(src.to(dst.dtype), non_blocking=True)  # converted where src lies: the copy is then async
    if not x.is_cuda:
        lib.host_swiglu(ctypes.addressof(args))
        return b.out.to(x.dtype, copy=True)
    fn = ctypes.cast(lib.host_swiglu, _P)
    err = _driver().cuLaunchHostFunc(_P(torch.cuda.current_stream(x.device).cuda_stream), fn, ctypes.addressof(args))
    if err:
        raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {err})")
    return b.out.to(x.device, non_blocking=True).to(x.dtype)
