"""Routers: softmax over all experts, top-k, the chosen weights renormalised to sum 1 (one kernel on a GPU);
and the biased choice of glm4moe (sigmoid scores, a correction bias steering the choice, groups), in torch.

Legend: T = tokens, D = hidden size, E = experts, K = experts used per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kernels import fused, matvec


def route_softmax_topk(
    x: torch.Tensor, w_router: torch.Tensor, k: int, renorm: bool = True, bias: torch.Tensor | None = None
):
    """Softmax over all experts of x [T, D] times w_router [E, D] (plus bias [E] if given), top-k, chosen
    weights renormalised to sum 1 (the same as a softmax over the top-k logits). Returns weights [T, K], ids
    [T, K]."""
    logits = matvec.linear_each_row(x, w_router)  # a decode batch's rows route as each would alone
    return softmax_topk(logits, k, x.dtype, renorm, bias)


def softmax_topk(
    logits: torch.Tensor, k: int, dtype: torch.dtype, renorm: bool = True, bias: torch.Tensor | None = None
):
    """route_softmax_topk from the router's logits [T, E] (plus bias [E]): weights [T, K] in dtype, ids [T, K]."""
    if fused.usable(logits) and (bias is None or bias.dtype == logits.dtype):  # one kernel, the bias added there
        return fused.softmax_topk(logits, k, renorm, dtype, bias)
    if bias is not None:
        logits = logits + bias
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@dataclass(frozen=True)
class BiasedTopK:
    """How a router with an expert-score correction bias picks (glm4moe; DeepSeek-V3's scheme): scores from the
    logits (`gating`), experts chosen on score + bias within the best `group_used` of `n_group` equal groups
    (a group ranked by the sum of its two best biased scores), weighted by the unbiased scores, normalised to
    sum 1 when `norm`, times `scale`."""

    k: int
    gating: str = "sigmoid"  # or "softmax"
    n_group: int = 1
    group_used: int = 1
    norm: bool = True
    scale: float = 1.0


def route_biased_topk(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, r: BiasedTopK):
    """x [T, D] routed by w_router [E, D] and the correction bias [E] as r says: weights [T, K] in x's dtype,
    ids [T, K]. The logits are computed in w_router's dtype (a float32 router routes as llama.cpp does)."""
    return biased_topk(matvec.linear_each_row(x.to(w_router.dtype), w_router), bias, r, x.dtype)


def biased_topk(logits: torch.Tensor, bias: torch.Tensor, r: BiasedTopK, dtype: torch.dtype):
    """route_biased_topk from the router's logits [T, E], in float32: weights [T, K] in dtype, ids [T, K]."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if r.gating == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores + bias.float()
    if r.n_group > 1:  # only the best groups' experts may be chosen
        T, E = choice.shape
        groups = choice.view(T, r.n_group, E // r.n_group)
        best = groups.topk(2, dim=-1).values.sum(-1)  # [T, G]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r.group_used, dim=-1).indices, True)
        choice = groups.masked_fill(~kept[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(r.k, dim=-1).indices
    weights = scores.gather(1, ids)
    if r.norm:  # the clamp keeps an all-but-zero row finite, as llama.cpp's does
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
    return (weights * r.scale).to(dtype), ids
