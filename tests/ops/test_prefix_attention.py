"""Prefill attention in chunks of the cached prefix: the softmax over every key written out (float64), at any
chunk size and depth, with temporaries that do not grow with the depth (counted by offload/device.CpuMemory)."""

from __future__ import annotations

import pytest
import torch
from test_attention import _reference as reference  # float64, the mask written out

from moestream.offload.device import CpuMemory
from moestream.ops.attention import causal_attention
from moestream.ops.prefix_attention import in_chunks, prefix_attention


@pytest.mark.parametrize(("T", "S", "chunk"), [(4, 4, 3), (5, 37, 8), (16, 300, 64), (3, 259, 256), (7, 71, 1)])
def test_prefix_in_chunks_is_the_whole_softmax(T, S, chunk):
    g = torch.Generator().manual_seed(T * S)
    H, Hkv, Dh = 8, 2, 16
    q = torch.randn(T, H, Dh, generator=g)
    k, v = (torch.randn(S, Hkv, Dh, generator=g) for _ in range(2))
    got = prefix_attention(q, k, v, key_chunk=chunk)
    err = (got.double() - reference(q, k, v)).abs().max().item()
    assert got.dtype == q.dtype and got.shape == q.shape
    assert err < 1e-5, f"max error {err:.2e}"


def test_causal_attention_chunks_only_deep_in_a_context():
    """Up to a chunk of prefix, one fused call (its bits unchanged); past it, chunks, the same numbers."""
    assert not in_chunks(512, 512 + 4096) and in_chunks(512, 512 + 4097)
    g = torch.Generator().manual_seed(3)
    T, S, H, Hkv, Dh = 8, 4096 + 200, 4, 1, 16
    q = torch.randn(T, H, Dh, generator=g)
    k, v = (torch.randn(S, Hkv, Dh, generator=g) for _ in range(2))
    err = (causal_attention(q, k, v).double() - reference(q, k, v)).abs().max().item()
    assert err < 1e-5, f"max error {err:.2e}"


def test_temporaries_do_not_grow_with_the_depth():
    """A micro-batch's attention at depth 16 chunks allocates what it does at depth 2 chunks."""
    g = torch.Generator().manual_seed(4)
    T, H, Hkv, Dh, chunk = 32, 8, 2, 32, 128
    q = torch.randn(T, H, Dh, generator=g)
    peaks = []
    for depth in (2 * chunk, 16 * chunk):
        k, v = (torch.randn(depth + T, Hkv, Dh, generator=g) for _ in range(2))
        with torch.inference_mode(), CpuMemory() as m:
            prefix_attention(q, k, v, key_chunk=chunk)
        peaks.append(m.peak)
    one_chunk_kv = 2 * chunk * H * Dh * 4  # a chunk's keys and values repeated to every query head
    assert peaks[1] == peaks[0], peaks
    assert one_chunk_kv <= peaks[0] < 4 * one_chunk_kv, (peaks, one_chunk_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # flash attention, the memory-efficient kernel
def test_the_gpu_kernels_give_the_whole_softmax(dtype):
    g = torch.Generator().manual_seed(5)
    T, S, H, Hkv, Dh = 64, 4096 + 700, 32, 4, 128
    q = torch.randn(T, H, Dh, generator=g)
    k, v = (torch.randn(S, Hkv, Dh, generator=g) for _ in range(2))
    got = prefix_attention(*(t.to("cuda", dtype) for t in (q, k, v)), key_chunk=1024).cpu()
    err = (got.double() - reference(q, k, v)).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"max error {err:.2e}"


@pytest.mark.gpu
def test_flash_reads_the_whole_prefix_in_place():
    """bf16 on a GPU: the prefix in one flash call over the cache's own KV heads, so a micro-batch at depth 32k
    allocates about what it does at 4k (flash's split-K partial sums grow a little: 240 KiB more on an H100),
    less than one chunk's keys repeated to every head, and gives the whole softmax."""
    g = torch.Generator().manual_seed(6)
    T, H, Hkv, Dh = 16, 32, 4, 128
    q = torch.randn(T, H, Dh, generator=g)
    peaks = []
    for depth in (4096, 32768):
        k, v = (torch.randn(depth + T, Hkv, Dh, generator=g) for _ in range(2))
        qd, kd, vd = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        got = prefix_attention(qd, kd, vd, key_chunk=1024)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        err = (got.cpu().double() - reference(q, k, v)).abs().max().item()
        assert err < 2e-2, f"depth {depth}: max error {err:.2e}"
    one_chunk_kv = 2 * 1024 * H * Dh * 2  # what the chunked path repeats for each chunk
    extra_kv = 2 * (32768 - 4096) * Hkv * Dh * 2  # the deeper prefix's own keys and values
    assert max(peaks) < one_chunk_kv and peaks[1] - peaks[0] < extra_kv / 100, (peaks, one_chunk_kv, extra_kv)
