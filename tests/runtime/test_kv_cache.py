"""The KV cache in each -ctk/-ctv type: what it allocates is what placement budgets (kv_cache_bytes), its rows
read back as their type keeps them, and a prefix of one sequence's rows copies into another's, directly or through
a copy in host RAM."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.kernels import kv_quant
from moestream.offload.placement import kv_cache_bytes
from moestream.ops.kv_rows import QuantizedRows
from moestream.runtime.kv_cache import KVCache

TYPES = [("f32", "f32"), ("f16", "f16"), ("bf16", "q8_0"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_0", "f16")]


def allocated(kv: KVCache) -> int:
    return sum(t.nbytes for store in (kv.k, kv.v) for t in store.values())


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("types", TYPES)
def test_the_budget_counts_what_the_cache_allocates(model_file, preset, types):
    e = moestream.load(model_file(preset, "Q8_0"), device="cpu", progress=False, n_ctx=96)
    try:
        s = e.spec
        kv = KVCache(e.model.attention_layers, 96, s.n_head_kv, s.head_dim, torch.float32, e.device, types)
        assert allocated(kv) == kv_cache_bytes(s, 96, torch.float32, type_k=types[0], type_v=types[1])
        assert kv_cache_bytes(s, 96, torch.float32) == kv_cache_bytes(s, 96, torch.float32, type_k="f32", type_v="f32")
        assert isinstance(kv.k[e.model.attention_layers[0]], QuantizedRows) == (types[0] != "f32")
    finally:
        e.close()


@pytest.mark.parametrize("types", TYPES)
def test_update_stores_rows_and_copy_prefix_moves_them_as_stored(types):
    torch.manual_seed(0)
    a = KVCache([0, 3], 40, 2, 64, torch.float32, torch.device("cpu"), types)
    b = KVCache([0, 3], 40, 2, 64, torch.float32, torch.device("cpu"), types)
    k, v = torch.randn(25, 2, 64), torch.randn(25, 2, 64)
    for il in (0, 3):
        a.update(il, 0, k[:10], v[:10])
        k_all, v_all = a.update(il, 10, k[10:], v[10:])
        assert k_all.shape == v_all.shape == (25, 2, 64)
    b.copy_prefix(a.rows(20))
    host = KVCache([0, 3], 40, 2, 64, torch.float32, torch.device("cpu"), types)
    host.copy_prefix(a.rows(25, "cpu").first(20))  # through a copy apart from the cache, as the prompt cache keeps
    for mine, theirs in ((host.k, b.k), (host.v, b.v)):
        assert all(torch.equal(_data(mine[il]), _data(theirs[il])) for il in (0, 3))
    for name, mine, theirs, values in ((types[0], b.k, a.k, k), (types[1], b.v, a.v, v)):
        got = mine[3].dequantize(0, 40, torch.float32) if isinstance(mine[3], QuantizedRows) else mine[3]
        want = theirs[3].dequantize(0, 20, torch.float32) if isinstance(theirs[3], QuantizedRows) else theirs[3][:20]
        assert torch.equal(got[:20], want) and not got[20:].any()
        if name in kv_quant.BLOCK_BYTES:  # rows read back as their blocks stand for
            assert torch.equal(
                want.view(20, -1), kv_quant.dequantize(kv_quant.quantize(values[:20], name), name, torch.float32)
            )
    with pytest.raises(ValueError, match="copied into"):
        b.copy_prefix(KVCache([0, 3], 40, 2, 64, torch.float32, torch.device("cpu"), ("f16", "q4_0")).rows(5))


def _data(store: torch.Tensor | QuantizedRows) -> torch.Tensor:
    return store.data if isinstance(store, QuantizedRows) else store
