"""The router's torch form: softmax over all experts, top-k, renormalised; a few rows routed as each alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.ops.router import route_softmax_topk, softmax_topk


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_picks_the_largest_and_renormalises(renorm):
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    weights, ids = softmax_topk(logits, 4, torch.float32, renorm)
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids, torch.topk(logits, 4).indices)
    want = probs.gather(1, ids)
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True) if renorm else want)


@pytest.mark.parametrize("T", [1, 3, 9])
def test_a_token_routes_as_it_would_alone(T):
    """A decode batch's rows (up to 4) route each as its own product; larger batches multiply at once."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(T, 32, generator=g), torch.randn(16, 32, generator=g)
    weights, ids = route_softmax_topk(x, w, 4)
    rows = [F.linear(row, w) for row in x.split(1)] if T <= 4 else [F.linear(x, w)]
    want_w, want_ids = softmax_topk(torch.cat(rows), 4, x.dtype)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
