"""The routed SwiGLU experts' weighted sum in torch: grouped over dense stacks (a prompt), split over devices
(`--devices`), or pair by pair through matvecs (a few tokens). `experts.py` picks among these and the kernels.

Legend: T = tokens, D = hidden size, E = experts, K = experts used per token, F = expert FFN size,
P = token-expert pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moestream.kernels.grouped_moe import grouped_mm

Stack = torch.Tensor | Callable[[], torch.Tensor]
"""An expert stack, or a function making it (dequantizing), called just before use."""

MatVec = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(which [P] matrix of a stack, rows [P, in]) -> [P, out]: each row times its own matrix."""


class ClampedGlu(NamedTuple):
    """gpt-oss's experts, as llama.cpp computes them (ggml's swiglu_oai): biases on gate, up and down, and
    h = g * sigmoid(alpha * g) * (u + 1) with g = min(gate + bias, limit), u = clamp(up + bias, -limit, limit).
    The biases come per token-expert pair (pair t*K+k: token t's k-th expert), gathered by the router's ids,
    so they follow the pairs whatever rows of which stacks the experts' bytes are."""

    gate_bias: torch.Tensor  # [P, F], pair t*K+k (or the rows of the pairs being computed)
    up_bias: torch.Tensor  # [P, F]
    down_bias: torch.Tensor  # [P, D]
    alpha: float
    limit: float

    def hidden(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h [P, F] of the pairs' gate and up products [P, F]."""
        g = (gate + self.gate_bias).clamp(max=self.limit)
        u = (up + self.up_bias).clamp(-self.limit, self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)

    def take(self, pairs: torch.Tensor) -> ClampedGlu:
        """The biases of some pairs (indices into P, on any device), on the biases' device."""
        return self._map(lambda b: b[pairs.to(b.device)])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ClampedGlu:
        return self._map(lambda b: b.to(device, dtype or b.dtype))

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> ClampedGlu:
        return self._replace(gate_bias=f(self.gate_bias), up_bias=f(self.up_bias), down_bias=f(self.down_bias))


def glu(gate: torch.Tensor, up: torch.Tensor, clamped: ClampedGlu | None) -> torch.Tensor:
    """An expert's hidden activations from its gate and up products: SwiGLU, or clamped's (its biases the
    products' rows')."""
    return F.silu(gate) * up if clamped is None else clamped.hidden(gate, up)


def down_out(y: torch.Tensor, clamped: ClampedGlu | None) -> torch.Tensor:
    """An expert's down product plus its bias where it has one."""
    return y if clamped is None else y + clamped.down_bias


def expert_counts(ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """Token-expert pairs per expert. Not torch.bincount: on CUDA it reads the max id back to the host."""
    return torch.zeros(n_expert, dtype=torch.int32, device=ids.device).index_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int32)
    )


def moe_swiglu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    n_expert: int,
    w_gate: Stack,
    w_up: Stack,
    w_down: Stack,
    clamped: ClampedGlu | None = None,
) -> torch.Tensor:
    """Sum over chosen experts of weight * down(silu(gate(x)) * up(x)), as one grouped computation (with
    clamped, gpt-oss's biased, clamped form).

    x [T, D]; weights, ids [T, K] (ids index the stacks); w_gate, w_up [E, F, D]; w_down [E, D, F], each
    a tensor or a function making it, called just before use so only one dequantized stack is alive.
    Deterministic: no atomics, so equal inputs give equal bits whatever the schedule.
    """
    return moe_swiglu_sharded(x, weights, ids, [(0, n_expert, (w_gate, w_up, w_down))], clamped)


def moe_swiglu_sharded(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shards: Sequence[tuple[int, int, tuple[Stack, Stack, Stack]]],
    clamped: ClampedGlu | None = None,
) -> torch.Tensor:
    """moe_swiglu with the experts split into consecutive id ranges (lo, hi, (gate, up, down) of experts
    lo..hi-1), each range's stacks on its own device: the rows routed to a range go there and their products
    come back. Each token-expert pair is computed exactly once, as in one device, so results are the same."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert
    rows = x[order // K]  # [T*K, D]
    ends = expert_counts(flat, shards[-1][1]).cumsum(0)
    # where each range's pairs end among the sorted ones: a host sync, only with more than one device
    before = F.pad(ends, (1, 0)).tolist() if len(shards) > 1 else None  # pairs routed below expert e
    cuts = [before[hi] for _, hi, _ in shards[:-1]] + [T * K] if before else [T * K]
    y_sorted = torch.empty_like(rows)
    start = 0
    for (lo, hi, (w_gate, w_up, w_down)), end in zip(shards, cuts, strict=True):
        if end == start:
            continue
        gate = w_gate() if callable(w_gate) else w_gate
        part = rows[start:end].to(gate.device)
        offs = (ends[lo:hi] - start).to(device=gate.device, dtype=torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor, offs=offs) -> torch.Tensor:
            return grouped_mm(a, w.transpose(1, 2), offs)

        biases = None if clamped is None else clamped.take(order[start:end]).to(gate.device)  # these pairs'
        h = mm(part, gate)
        del gate
        h = glu(h, mm(part, w_up() if callable(w_up) else w_up), biases)
        y_sorted[start:end] = down_out(mm(h, w_down() if callable(w_down) else w_down), biases).to(x.device)
        start = end
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return (y.view(T, K, -1) * weights[..., None]).sum(dim=1)


def moe_swiglu_picked(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: MatVec,
    up: MatVec,
    down: MatVec,
    clamped: ClampedGlu | None = None,
):
    """moe_swiglu for a few tokens: each token-expert pair multiplies its expert's matrices directly, with no
    grouping (the kernels read the chosen experts' blocks wherever they lie)."""
    T, K = ids.shape
    picks = ids.reshape(-1)  # pair t*K+k: token t, its k-th expert
    rows = x.repeat_interleave(K, dim=0)
    h = glu(gate(picks, rows), up(picks, rows), clamped)
    return (down_out(down(picks, h), clamped).view(T, K, -1) * weights[..., None]).sum(dim=1)
