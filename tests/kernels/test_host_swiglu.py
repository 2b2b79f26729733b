"""A streamed layer's experts on the CPU as a host function: the same numbers as the int8 matvecs composed in
torch, and on a GPU the same inside a replayed CUDA graph as queued eagerly."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quantize import quantize
from moestream.kernels import cpu_quant, host_swiglu
from moestream.ops.moe_swiglu import ClampedGlu, moe_swiglu_picked

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler")

E, F, D = 6, 512, 768


def stacks(types):
    rng = np.random.default_rng(0)
    shapes = ((E, F, D), (E, F, D), (E, D, F))
    return [
        torch.from_numpy(quantize((rng.standard_normal(s) * 0.05).astype(np.float32), q))
        for s, q in zip(shapes, types, strict=True)
    ]


def rows(seed: int):
    """Two tokens' x, their picks of 3 of the 6 experts (one expert picked by both) and weights; the generator."""
    g = torch.Generator().manual_seed(seed)
    return g, (torch.randn(2, D, generator=g), torch.tensor([[0, 5, 2], [3, 5, 1]]), torch.rand(2, 3, generator=g))


def composed(x, weights, ids, raws, types, int8):
    dot = partial(cpu_quant.matvec, int8=int8)
    mvs = [lambda p, rows, r=r, q=q: dot(r, q, r.shape[1], rows, p) for r, q in zip(raws, types, strict=True)]
    return moe_swiglu_picked(x, weights, ids, *mvs)


@pytest.mark.parametrize(
    ("types", "int8"),
    [
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), True),
        ((Q.MXFP4, Q.MXFP4, Q.IQ4_XS), True),
        ((Q.IQ3_S, Q.IQ3_S, Q.Q5_0), False),
    ],
    ids=["Q4_K_M", "MXFP4+IQ4_XS", "float-only types"],
)
def test_host_function_equals_the_composed_matvecs(types, int8):
    """Types with integer dots use them (x and the hidden rows rounded to int8), the others float products."""
    raws = stacks(types)
    _, (x, ids, weights) = rows(1)
    ref = composed(x, weights, ids, raws, types, int8)
    got = host_swiglu.swiglu(x, weights, ids, raws, types)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_a_replayed_graph_as_queued_eagerly():
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    raws = stacks(types)
    assert host_swiglu.usable(types, torch.device("cuda"))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, D, generator=g).cuda().bfloat16()
    ids, weights = torch.tensor([[4, 1, 0]], device="cuda"), torch.rand(1, 3, generator=g).cuda()
    cpu = host_swiglu.swiglu(x.cpu().float(), weights.cpu(), ids.cpu(), raws, types)
    eager = host_swiglu.swiglu(x, weights, ids, raws, types)
    torch.cuda.synchronize()
    assert torch.equal(eager, cpu.bfloat16().cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = host_swiglu.swiglu(x, weights, ids, raws, types) * 2
    x.copy_(-x)  # the replay must read the new x: out = 2 * experts(-x)
    graph.replay()
    torch.cuda.synchronize()
    want = host_swiglu.swiglu(x.cpu().float(), weights.cpu(), ids.cpu(), raws, types)
    assert torch.equal(out, (want.bfloat16() * 2).cuda())


def test_tokens_sharing_experts_get_the_bits_each_gets_alone():
    """A batch's tokens sharing experts (a server's batched pass): every token's output is bit for bit its own
    pass's, however many tokens share an expert."""
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    raws = stacks(types)
    g = torch.Generator().manual_seed(5)
    x, weights = torch.randn(4, D, generator=g), torch.rand(4, 3, generator=g)
    ids = torch.tensor([[0, 5, 2], [5, 0, 1], [5, 3, 2], [4, 1, 3]])  # 5 picked by three tokens, 0-3 by two
    together = host_swiglu.swiglu(x, weights, ids, raws, types)
    for t in range(4):
        alone = host_swiglu.swiglu(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], raws, types)
        assert torch.equal(together[t : t + 1], alone), t


def test_gpt_oss_clamped_glu_with_the_pairs_biases():
    types = (Q.MXFP4, Q.MXFP4, Q.MXFP4)  # gpt-oss's experts
    raws = stacks(types)
    g, (x, ids, weights) = rows(3)
    biases = [torch.randn(6, n, generator=g) for n in (F, F, D)]  # pair t*K+k
    clamped = ClampedGlu(*biases, alpha=1.702, limit=0.05)  # a limit the products reach: both clamps matter
    dot = partial(cpu_quant.matvec, int8=True)
    mvs = [lambda p, rows, r=r, q=q: dot(r, q, r.shape[1], rows, p) for r, q in zip(raws, types, strict=True)]
    ref = moe_swiglu_picked(x, weights, ids, *mvs, clamped)
    got = host_swiglu.swiglu(x, weights, ids, raws, types, clamped)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6
    assert float((got - composed(x, weights, ids, raws, types, True)).abs().max()) > 0.1  # the GLU did change it


def test_a_host_function_in_a_gpu_stream_leaves_a_core_to_the_thread_waiting_for_it(monkeypatch):
    """In a GPU's stream the thread waiting for the stream spins on a core: the host function takes one
    fewer; called here (the CPU device) it takes torch's count."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    raws = stacks((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    for queued, want in ((True, 15), (False, 16)):
        b = host_swiglu.Buffers(1, 2, D, F, pin=False)
        b.queued = queued  # as a GPU's buffers are (pinned there)
        assert b.args_for(raws, [Q.Q4_K, Q.Q4_K, Q.Q6_K], 1, 2, D, F, None).n_threads == want
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert host_swiglu.threads(True) == host_swiglu.threads(False) == 1
