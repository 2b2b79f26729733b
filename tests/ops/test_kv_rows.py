"""Stored KV rows (ops/kv_rows.py): writes, views, prefix copies and dequantized ranges against
kernels/kv_quant.py, and row_attention (chunked, any stored type) against SDPA (masked_attention) over the
same rows dequantized whole: full, windowed, with sinks, keys in several chunks."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import kv_quant
from moestream.ops import kv_rows
from moestream.ops.attention import causal_attention, masked_attention
from moestream.ops.kv_rows import QuantizedRows, row_attention

TYPES = ["q8_0", "q4_0", "f16", "bf16"]


def filled(name: str, n: int = 50, hkv: int = 2, dh: int = 64, seed: int = 0) -> tuple[QuantizedRows, torch.Tensor]:
    torch.manual_seed(seed)
    values = torch.randn(n, hkv, dh)
    rows = QuantizedRows.empty(name, n + 14, hkv, dh, torch.device("cpu"))
    rows.write(0, values[:20])
    rows.write(torch.arange(20, n), values[20:])  # device positions, as a static batch writes
    return rows, values


@pytest.mark.parametrize("name", TYPES)
def test_rows_store_what_their_type_keeps(name):
    rows, values = filled(name)
    assert rows.shape == (64, 2, 64) and rows[:50].shape == (50, 2, 64)
    got = rows.dequantize(10, 50, torch.float32)
    if name in kv_quant.BLOCK_BYTES:
        want = kv_quant.dequantize(kv_quant.quantize_torch(values[10:50].reshape(40, -1), name), name, torch.float32)
        assert rows.data.dtype == torch.uint8 and rows.nbytes == 64 * kv_quant.row_bytes(name, 128)
    else:
        want = values[10:50].to(kv_quant.FLOATS[name]).float()
    assert torch.equal(got, want.view(40, 2, 64))
    assert torch.equal(rows.dequantize(50, 64, torch.float32), torch.zeros(14, 2, 64))


def test_copy_copies_a_prefix_and_refuses_another_layout():
    src, _ = filled("q8_0")
    dst = QuantizedRows.empty("q8_0", 64, 2, 64, torch.device("cpu"))
    dst[:30].copy_(src[:30])
    assert torch.equal(dst.data[:30], src.data[:30]) and not dst.data[30:].any()
    with pytest.raises(ValueError, match="rows of q4_0"):
        dst[:3].copy_(QuantizedRows.empty("q4_0", 64, 2, 64, torch.device("cpu"))[:3])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("window,sinks", [(0, False), (7, False), (0, True), (5, True)])
def test_row_attention_matches_sdpa_over_the_dequantized_rows(monkeypatch, name, window, sinks):
    monkeypatch.setattr(kv_rows, "CHUNK_ROWS", 16)  # 50 keys in four chunks, one partial
    k, _ = filled(name, seed=1)
    v, _ = filled(name, seed=2)
    q = torch.randn(4, 6, 64)  # G = 3
    positions = torch.tensor([0, 15, 16, 49])
    head_sinks = torch.randn(6) if sinks else None
    got = row_attention(q, k[:50], v[:50], positions, head_sinks, window)
    dk, dv = (c.dequantize(0, 50, torch.float32) for c in (k, v))
    want = masked_attention(q, dk, dv, positions, head_sinks, window)
    assert (got - want).abs().max() < 1e-5


def test_causal_attention_reads_stored_rows_as_their_values():
    k, _ = filled("q4_0", seed=3)
    v, _ = filled("q8_0", seed=4)
    q = torch.randn(6, 4, 64)
    got = causal_attention(q, k[:50], v[:50])  # the last 6 positions of 50
    want = causal_attention(q, k.dequantize(0, 50, torch.float32), v.dequantize(0, 50, torch.float32))
    assert (got - want).abs().max() < 1e-5


def test_heads_not_in_whole_blocks_are_a_clear_error():
    from moestream.errors import MoestreamError

    with pytest.raises(
        MoestreamError, match="heads of a multiple of 32 values; this model's have 16: use -ctk/-ctv f16"
    ):
        QuantizedRows.empty("q4_0", 8, 2, 16, torch.device("cpu"))
    assert QuantizedRows.empty("bf16", 8, 2, 16, torch.device("cpu")).shape == (8, 2, 16)
