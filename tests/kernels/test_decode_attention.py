"""Triton decode attention against masked_attention (SDPA with a boolean mask) in float32, for float32 and
bf16 inputs: per-token positions, chunks past them, grouped and ungrouped heads, and a CUDA graph replay."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.kernels import tuning
from moestream.kernels.decode_attention import attention, chunk_warps, triton, usable
from moestream.kernels.launch import multiprocessors
from moestream.ops.attention import masked_attention

CUDA = torch.cuda.is_available()
# Without a GPU, Triton's interpreter (TRITON_INTERPRET=1, triton importable) runs the float32 cases on "cpu"
# (its bf16 tl.dot is wrong): pytest -m gpu tests/kernels/test_decode_attention.py before device time is spent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or the interpreter")]

DEVICE = "cuda" if CUDA else "cpu"

CASES = [  # T, H, Hkv, Dh, S, positions
    (1, 32, 4, 128, 4096, [4095]),  # every key
    (1, 32, 4, 128, 32768, [3]),  # every chunk but the first past the position
    (1, 32, 4, 128, 32768, [20000]),
    (4, 32, 4, 128, 1024, [0, 1, 511, 1023]),  # the first token sees key 0 alone
    (8, 16, 2, 128, 2048, [0, 255, 256, 257, 1000, 1500, 2046, 2047]),
    (3, 8, 8, 128, 512, [0, 100, 511]),  # G = 1
    (2, 64, 8, 128, 8192, [8191, 4096]),  # G = 8
    (2, 16, 4, 64, 256, [17, 255]),
    (2, 16, 2, 256, 1024, [600, 1023]),
    (1, 8, 2, 128, 64, [63]),
    (1, 32, 4, 128, 256, [100]),  # qwen3-30b's first bucket: one chunk, which normalises itself (no combine)
    (3, 12, 4, 256, 300, [0, 1, 299]),  # one chunk: G = 3 padded to 16, Dh 256, a bucket of partial blocks
    (4, 16, 2, 128, 100, [0, 2, 50, 99]),  # one chunk, tokens seeing one to a hundred keys
    (1, 32, 4, 128, 5000, [4999]),  # chunks sized for 5120 keys (an eighth of 8192 a step): the last part-full
    (1, 32, 4, 128, 32896, [32768]),  # bench -d 32768 -n 128's last bucket: 36864 keys, not 65536
]


def inputs(
    T: int, H: int, Hkv: int, Dh: int, S: int, positions: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q as a slice of a fused projection (strided), k and v as the first S rows of longer caches."""
    torch.manual_seed(0)
    q = torch.randn(T, H + 2 * Hkv, Dh, device=DEVICE).to(dtype)[:, :H]
    k = torch.randn(S + 100, Hkv, Dh, device=DEVICE).to(dtype)[:S]
    v = torch.randn(S + 100, Hkv, Dh, device=DEVICE).to(dtype)[:S]
    return q, k, v, torch.tensor(positions, device=DEVICE)


def worst_error(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> float:
    """Largest error against the float32 reference, relative to each token's largest output."""
    ref = masked_attention(q.float(), k.float(), v.float(), positions)
    return float(((got.float() - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))).max())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T,H,Hkv,Dh,S,positions", CASES)
def test_matches_masked_attention(T, H, Hkv, Dh, S, positions, dtype, tol):
    if DEVICE == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 tl.dot is wrong")
    q, k, v, pos = inputs(T, H, Hkv, Dh, S, positions, dtype)
    got = attention(q, k, v, pos)
    assert got.dtype == dtype and got.shape == (T, H, Dh)
    err = worst_error(got, q, k, v, pos)
    assert err < tol, f"{err:.2e}"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_replays_in_a_cuda_graph():
    q, k, v, pos = inputs(2, 32, 4, 128, 4096, [10, 3000], torch.bfloat16)
    assert usable(q) and not usable(q.cpu()) and not usable(q[..., :96])
    attention(q, k, v, pos)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, pos)
    for positions in ([10, 3000], [4095, 0]):
        pos.copy_(torch.tensor(positions))
        graph.replay()
        assert worst_error(out, q, k, v, pos) < 2e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_chunk_programs_take_more_warps_where_each_has_a_multiprocessor():
    """CASES run both: (1, 32, 4, 128, 4096) is 64 programs, (1, 32, 4, 128, 32768) 256."""
    t, device = tuning.current(), torch.device("cuda")
    n = multiprocessors(device)
    assert chunk_warps(n, device, t) == t.attention_spread_warps != chunk_warps(n + 1, device, t)


SINK_CASES = [  # T, H, Hkv, Dh, S, positions, window: gpt-oss's sinks, alone and with a sliding window
    (2, 8, 2, 64, 300, [5, 299], 0),  # one chunk
    (3, 8, 2, 64, 300, [0, 130, 299], 128),  # one chunk, the window cutting blocks before it
    (2, 16, 2, 64, 8192, [100, 8000], 0),  # several chunks: the sink joins the combine
    (2, 16, 2, 64, 8192, [100, 8000], 128),  # several chunks, all but one or two before the window
    (2, 12, 4, 32, 2048, [1000, 2047], 7),  # an odd window
    (12, 8, 2, 64, 1000, list(range(988, 1000)), 128),  # a prompt's queries at the last positions of 1000 keys
]


@pytest.mark.parametrize("T,H,Hkv,Dh,S,positions,window", SINK_CASES)
def test_sinks_and_window_match_masked_attention(T, H, Hkv, Dh, S, positions, window):
    q, k, v, pos = inputs(T, H, Hkv, Dh, S, positions, torch.float32)
    sinks = torch.randn(H, device=DEVICE) * 3  # some heads' sinks outweigh every key
    got = attention(q, k, v, pos, sinks, window)
    ref = masked_attention(q.cpu(), k.cpu(), v.cpu(), pos.cpu(), sinks.cpu(), window)  # SDPA with a float mask
    err = float(((got.cpu() - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))).max())
    assert err < 1e-4, f"{err:.2e}"


STORED_CASES = [  # T, H, Hkv, Dh, S, positions, window, sinks: caches of another type, read tile by tile
    (1, 8, 2, 64, 200, [199], 0, False),  # one chunk
    (2, 16, 2, 64, 4096, [100, 4000], 0, False),  # split-K at depth: chunks past the position skipped
    (2, 16, 2, 64, 4096, [300, 4095], 128, True),  # gpt-oss: the window's chunks alone, sinks in the merge
    (3, 8, 4, 128, 700, [0, 350, 699], 0, True),  # G = 2, Dh 128 (four blocks a head)
    (12, 8, 2, 64, 1000, list(range(988, 1000)), 0, False),  # a prompt's queries at the last positions
    (1, 16, 2, 256, 2048, [1500], 0, False),  # qwen3.6's attention layers: Dh 256 (eight blocks a head), G = 8
]


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")])
@pytest.mark.parametrize("T,H,Hkv,Dh,S,positions,window,sinks", STORED_CASES)
def test_stored_caches_match_masked_attention_over_their_values(
    T, H, Hkv, Dh, S, positions, window, sinks, type_k, type_v
):
    """The kernel reads Q8_0/Q4_0 blocks (and an f16 cache under float32 queries) as the values they stand for."""
    from moestream.ops.kv_rows import QuantizedRows

    q, k, v, pos = inputs(T, H, Hkv, Dh, S, positions, torch.float32)
    stores = []
    for values, name in ((k, type_k), (v, type_v)):
        rows = QuantizedRows.empty(name, S + 5, Hkv, Dh, torch.device(DEVICE))
        rows.write(0, values)
        stores.append(rows)
    head_sinks = torch.randn(H, device=DEVICE) * 3 if sinks else None
    got = masked_attention(q, stores[0][:S], stores[1][:S], pos, head_sinks, window)  # the kernel on CUDA
    if not CUDA:
        data = [(r.data[:S], r.name if r.quantized else None) for r in stores]
        got = attention(q, data[0][0], data[1][0], pos, head_sinks, window, (data[0][1], data[1][1]))
    dk, dv = (r.dequantize(0, S, torch.float32).cpu() for r in stores)
    ref = masked_attention(q.cpu(), dk, dv, pos.cpu(), None if head_sinks is None else head_sinks.cpu(), window)
    err = float(((got.cpu() - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))).max())
    assert err < 1e-4, f"{err:.2e}"
