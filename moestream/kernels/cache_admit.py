"""The expert cache's admissions (offload/expert_cache.py, --cache-policy lru / lfu) as one launch a layer: which
picked experts take which rows, and the maps updated, on the device inside a captured step. The same choice as
ExpertCache's torch form, which the CPU device runs: the picks the cache lacks, best worth first (ties: the lower
expert, then the earlier pick), each paired with the row least worth keeping (ties: the lower row) and admitted
where it is worth more. The sorts are ranks counted over all pairs: a layer has at most a few hundred rows and
picks.
"""

from __future__ import annotations

import torch

from moestream.kernels.launch import on_device, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _admit_kernel(
        picks,
        first,
        mats,
        slot_of,
        expert_of,
        score,
        src_rows,
        to,
        admitted,
        expert_bytes,
        n_picks,
        n_rows,
        LRU: tl.constexpr,
        BP: tl.constexpr,
        BN: tl.constexpr,
    ):
        """One program: picks [n_picks] (first: first_picks), slot_of [n_expert] and expert_of [n_rows] updated in
        place; pick j's source row mats[j] to src_rows[j], its cache row (or -1) to to[j]."""
        inf = float("inf")
        j = tl.arange(0, BP)
        live = j < n_picks
        ids = tl.load(picks + j, mask=live, other=1 << 62)
        r = tl.arange(0, BN)
        real = r < n_rows
        held = tl.load(expert_of + r, mask=real, other=-1)
        in_pass = tl.max(((held[:, None] == ids[None, :]) & live[None, :]).to(tl.int32), axis=1) > 0
        keep = tl.load(score + tl.maximum(held, 0), mask=real & (held >= 0), other=0).to(tl.float64)
        keep = tl.where(held >= 0, keep, -inf)
        keep = tl.where(in_pass & (held >= 0), inf, keep)
        keep = tl.where(real, keep, inf)
        ks, kr = keep[None, :], keep[:, None]
        row_rank = tl.sum(((ks < kr) | ((ks == kr) & (r[None, :] < r[:, None]))).to(tl.int32), axis=1)

        lead = tl.load(first + j, mask=live, other=-1) == j
        new = live & lead & (tl.load(slot_of + ids, mask=live, other=0) < 0)
        if LRU:
            worth = tl.full((BP,), inf, tl.float64)
        else:
            worth = tl.load(score + ids, mask=live, other=0).to(tl.float64) + 1
        worth = tl.where(new, worth, -inf)
        k = j[None, :]
        wk, wj, ik, ij = worth[None, :], worth[:, None], ids[None, :], ids[:, None]
        ahead = (wk > wj) | ((wk == wj) & ((ik < ij) | ((ik == ij) & (k < j[:, None]))))
        pick_rank = tl.sum(ahead.to(tl.int32), axis=1)

        pair = pick_rank[:, None] == row_rank[None, :]  # [BP, BN]: the row of the same rank
        victim = tl.max(tl.where(pair, r[None, :], -1), axis=1)
        kept = tl.max(tl.where(pair, keep[None, :], -inf), axis=1)
        gone = tl.max(tl.where(pair, held[None, :], -1), axis=1)
        take = live & (pick_rank < tl.minimum(n_picks, n_rows)) & (worth > kept)
        tl.store(src_rows + j, tl.load(mats + j, mask=live, other=0), mask=live)
        tl.store(to + j, tl.where(take, victim, -1).to(tl.int64), mask=live)
        tl.store(slot_of + gone, tl.full((BP,), -1, tl.int64), mask=take & (gone >= 0))
        tl.store(slot_of + ids, victim.to(tl.int64), mask=take)
        tl.store(expert_of + victim, ids, mask=take)
        tl.atomic_add(admitted, tl.sum(take.to(tl.int64), axis=0) * expert_bytes)


def admit(
    picks: torch.Tensor,
    first: torch.Tensor,
    mats: torch.Tensor,
    slot_of: torch.Tensor,
    expert_of: torch.Tensor,
    score: torch.Tensor,
    lru: bool,
    admitted: torch.Tensor,
    expert_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ExpertCache.admit's choice and map updates in one launch (slot_of, expert_of and admitted, the bytes
    copied, change in place); returns (source row, cache row or -1) for each pick, for copy_rows."""
    n = picks.numel()
    src_rows, to = (torch.empty(n, dtype=torch.long, device=picks.device) for _ in range(2))
    with on_device(picks):
        _admit_kernel[(1,)](
            picks,
            first,
            mats,
            slot_of,
            expert_of,
            score,
            src_rows,
            to,
            admitted,
            expert_bytes,
            n,
            expert_of.numel(),
            LRU=lru,
            BP=triton.next_power_of_2(n),
            BN=triton.next_power_of_2(expert_of.numel()),
        )
    return src_rows, to
