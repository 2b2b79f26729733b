"""A layer's routed experts, computed from their stored bytes: what a model's MoE block runs on what its expert
source hands it (`StoredExperts`). Where the bytes come from (resident, a staging slot, gathered from the
page-locked map, a prefetch ring) is the offload layer's business; how to multiply them is decided here, from
where they lie and how many tokens there are:

- a token or few on a GPU: quantized matvecs straight from the blocks (`kernels/moe_matvec.py`), fused where
  the types allow;
- on the host (`--small-batch cpu`), or a token or few on the CPU device: the compiled CPU matvec (beside a
  GPU as a host function in its stream, `kernels/host_swiglu.py`), or float32 dequantization without it;
- split over several devices (`--devices`): each range of experts on its own;
- otherwise the grouped SwiGLU over dequantized stacks, of just the picked rows when there are fewer picks
  than rows.

Legend: T = tokens, D = hidden size, K = experts used per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from moestream.kernels import cpu_quant, host_swiglu, matvec, moe_matvec
from moestream.ops.linear import cpu_reads
from moestream.ops.moe_swiglu import ClampedGlu, moe_swiglu, moe_swiglu_picked, moe_swiglu_sharded

Dequantize = Callable[[int, torch.Tensor | None], torch.Tensor]
"""(stack: 0 gate, 1 up, 2 down; rows of it or None for all) -> the dense weights on the bytes' device."""


@dataclass(frozen=True)
class StoredExperts:
    """A layer's gate, up and down stacks as stored (bytes on one device, or the host), and the picks' rows.

    ids [T, K] index the stacks' rows: the router's ids for a whole layer, rows of a gathered subset else.
    dequantize is the source's, so it can time the work; on_host runs the math on the CPU and sends the result
    back; parts splits the experts into id ranges (lo, hi, that range's StoredExperts) on their own devices."""

    raws: tuple[torch.Tensor, ...]
    qtypes: tuple
    shapes: tuple[tuple[int, ...], ...]  # each stack's stored shape: (E, F, D) gate and up, (E, D, F) down
    ids: torch.Tensor
    dequantize: Dequantize
    on_host: bool = False
    parts: tuple[tuple[int, int, StoredExperts], ...] = ()

    @property
    def n_rows(self) -> int:
        """Experts the stacks hold."""
        return self.raws[0].shape[0]


class ExpertSource(Protocol):
    """What a MoE layer asks of the offload layer: its routed experts' stored bytes, wherever they live, as a
    StoredExperts for routed_swiglu (x [T, D], ids [T, K])."""

    def weights(self, il: int, x: torch.Tensor, ids: torch.Tensor) -> StoredExperts: ...


def routed_swiglu(
    x: torch.Tensor,
    weights: torch.Tensor,
    w: StoredExperts,
    residual: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    clamped: ClampedGlu | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x)); x [T, D], weights [T, K].
    With clamped, gpt-oss's experts instead: biased gate, up and down, and the clamped GLU (ops/moe_swiglu.py).
    With shared (out [T, D], gate logit [T, 1]), plus sigmoid(logit) * out (a shared expert behind its gate);
    with residual [T, D], residual + all that (the layer's skip connection). Each added as torch adds two
    tensors of x's dtype; inside the sum's launch where the kernels fuse, launches a layer fewer (there, on
    sm_90, the shared expert's product and sum round once, a bf16 FMA: a rounding step from torch's form)."""
    T = w.ids.shape[0]
    local = not (w.parts or w.on_host)
    fused = local and all(matvec.usable(q, x.device, T) for q in w.qtypes)
    if fused and moe_matvec.fuses(w.qtypes):  # three launches for the whole layer
        args = x, weights, w.ids, list(w.raws), w.qtypes, w.shapes[0][1]
        clamped = None if clamped is None else clamped.to(x.device, x.dtype)
        if all(t is None or t.dtype == x.dtype for t in (residual, shared and shared[0])):
            return moe_matvec.swiglu_picked(*args, residual, shared, clamped)
        out = moe_matvec.swiglu_picked(*args, clamped=clamped)
    elif fused:
        out = moe_swiglu_picked(x, weights, w.ids, *matvecs(matvec.matvec, w), clamped)
    elif local and all(cpu_reads(x, q) for q in w.qtypes):  # the CPU device: from the blocks, as on the host
        clamped = None if clamped is None else clamped.to("cpu", torch.float32)
        out = moe_swiglu_picked(x.float(), weights.float(), w.ids, *matvecs(cpu_quant.matvec, w), clamped).to(x.dtype)
    else:
        out = _unfused(x, weights, w, clamped)
    if shared is not None:  # else torch's type promotion picks the dtypes, as the layers would
        out = out + torch.sigmoid(shared[1]) * shared[0]
    return out if residual is None else residual + out


def _unfused(x: torch.Tensor, weights: torch.Tensor, w: StoredExperts, clamped: ClampedGlu | None) -> torch.Tensor:
    """routed_swiglu where the quantized matvecs do not serve: split over devices, on the host, or dequantized."""
    if w.parts:
        shards = [(lo, hi, _lazy(part, None)) for lo, hi, part in w.parts]
        return moe_swiglu_sharded(x, weights, w.ids, shards, clamped)
    if w.on_host:
        return _on_host(x, weights, w, clamped)
    ids = w.ids
    T, K = ids.shape
    if T * K < w.n_rows:  # few tokens: dequantize just the chosen experts, one per token-expert pair
        pairs = torch.arange(T * K, device=x.device).view(T, K)
        return moe_swiglu(x, weights, pairs, T * K, *_lazy(w, ids.reshape(-1)), clamped)
    return moe_swiglu(x, weights, ids, w.n_rows, *_lazy(w, None), clamped)


def _on_host(x: torch.Tensor, weights: torch.Tensor, w: StoredExperts, clamped: ClampedGlu | None) -> torch.Tensor:
    """The chosen experts on the CPU straight from the stored blocks, moving a few rows of x, not weights."""
    if host_swiglu.usable(w.qtypes, x.device):  # queued on the GPU's stream: no sync
        return host_swiglu.swiglu(x, weights, w.ids, w.raws, w.qtypes, clamped)
    xh, wh, ids = x.float().cpu(), weights.float().cpu(), w.ids.cpu()
    clamped = None if clamped is None else clamped.to("cpu", torch.float32)
    if all(q in cpu_quant.TYPES for q in w.qtypes) and cpu_quant.available():
        # beside a GPU, x rounded to int8 as llama.cpp's CPU experts do (~3x the rate; host_swiglu too); the
        # CPU device's own engine keeps float products: it is the reference the other ways are checked against
        dot = partial(cpu_quant.matvec, int8=x.device.type != "cpu")
        out = moe_swiglu_picked(xh, wh, ids, *matvecs(dot, w), clamped)
    else:
        used = torch.unique(ids)
        local = torch.full((w.n_rows,), -1, dtype=torch.long)
        local[used] = torch.arange(used.numel())  # expert id -> its row among the chosen ones
        out = moe_swiglu(xh, wh, local[ids], used.numel(), *_lazy(w, used), clamped)
    return out.to(device=x.device, dtype=x.dtype)


def _lazy(w: StoredExperts, rows: torch.Tensor | None) -> tuple:
    """The three stacks (of rows, or whole) as functions dequantizing when called: one alive at a time."""
    return tuple(partial(w.dequantize, s, rows) for s in range(3))


def matvecs(dot: Callable, w: StoredExperts) -> list:
    """The gate, up and down MatVecs of w's bytes by a kernel's matvec (matvec.matvec, cpu_quant.matvec)."""
    return [
        lambda picks, rows, raw=raw, q=q, shape=shape: dot(raw, q, shape[1], rows, picks)
        for raw, q, shape in zip(w.raws, w.qtypes, w.shapes, strict=True)
    ]
