"""The router: softmax over all experts, top-k, the chosen weights renormalised to sum 1 (one kernel on a GPU).

Legend: T = tokens, D = hidden size, E = experts, K = experts used per token.
"""

from __future__ import annotations

import torch

from moestream.kernels import fused, matvec


def route_softmax_topk(
    x: torch.Tensor, w_router: torch.Tensor, k: int, renorm: bool = True, bias: torch.Tensor | None = None
):
    """Softmax over all experts of x [T, D] times w_router [E, D] (plus bias [E] if given), top-k, chosen
    weights renormalised to sum 1 (the same as a softmax over the top-k logits). Returns weights [T, K], ids
    [T, K]."""
    logits = matvec.linear_each_row(x, w_router)  # a decode batch's rows route as each would alone
    if bias is not None:
        logits = logits + bias
    return softmax_topk(logits, k, x.dtype, renorm)


def softmax_topk(logits: torch.Tensor, k: int, dtype: torch.dtype, renorm: bool = True):
    """route_softmax_topk from the router's logits [T, E]: weights [T, K] in dtype, ids [T, K]."""
    if fused.usable(logits):  # softmax, top-k and renormalisation in one kernel
        return fused.softmax_topk(logits, k, renorm, dtype)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids
