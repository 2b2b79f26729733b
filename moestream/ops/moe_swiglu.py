"""The routed SwiGLU experts' weighted sum in torch: grouped over dense stacks (a prompt), split over devices
(`--devices`), or pair by pair through matvecs (a few tokens). `experts.py` picks among these and the kernels.

Legend: T = tokens, D = hidden size, E = experts, K = experts used per token, F = expert FFN size,
P = token-expert pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from moestream.kernels.grouped_moe import grouped_mm

Stack = torch.Tensor | Callable[[], torch.Tensor]
"""An expert stack, or a function making it (dequantizing), called just before use."""

MatVec = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(which [P] matrix of a stack, rows [P, in]) -> [P, out]: each row times its own matrix."""


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
) -> torch.Tensor:
    """Sum over chosen experts of weight * down(silu(gate(x)) * up(x)), as one grouped computation.

    x [T, D]; weights, ids [T, K] (ids index the stacks); w_gate, w_up [E, F, D]; w_down [E, D, F], each
    a tensor or a function making it, called just before use so only one dequantized stack is alive.
    Deterministic: no atomics, so equal inputs give equal bits whatever the schedule.
    """
    return moe_swiglu_sharded(x, weights, ids, [(0, n_expert, (w_gate, w_up, w_down))])


def moe_swiglu_sharded(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shards: Sequence[tuple[int, int, tuple[Stack, Stack, Stack]]],
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

        h = F.silu(mm(part, gate))
        del gate
        h = h * mm(part, w_up() if callable(w_up) else w_up)
        y_sorted[start:end] = mm(h, w_down() if callable(w_down) else w_down).to(x.device)
        start = end
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return (y.view(T, K, -1) * weights[..., None]).sum(dim=1)


def moe_swiglu_picked(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: MatVec, up: MatVec, down: MatVec
):
    """moe_swiglu for a few tokens: each token-expert pair multiplies its expert's matrices directly, with no
    grouping (the kernels read the chosen experts' blocks wherever they lie)."""
    T, K = ids.shape
    picks = ids.reshape(-1)  # pair t*K+k: token t, its k-th expert
    rows = x.repeat_interleave(K, dim=0)
    h = F.silu(gate(picks, rows)) * up(picks, rows)
    return (down(picks, h).view(T, K, -1) * weights[..., None]).sum(dim=1)
