"""Loading details: tensor shapes that converters write either way, token ids out of range."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile
from moestream.formats.writer import TensorPlan, write_gguf


def test_shared_expert_gate_stored_as_a_vector(model_file, tmp_path):
    """ffn_gate_inp_shexp may be {n_embd, 1} or {n_embd}: both load and give the same logits."""
    src, dst = model_file("tiny-qwen35moe", "F32"), tmp_path / "flat-gate.gguf"
    with GGUFFile(src) as f:
        plans = [
            TensorPlan(n, t.qtype, t.shape[1:] if "ffn_gate_inp_shexp" in n else t.shape) for n, t in f.tensors.items()
        ]
        data = {n: np.array(t.data).reshape(-1, t.data.shape[-1]) for n, t in f.tensors.items()}
        write_gguf(dst, f.architecture, dict(f.metadata), plans, lambda p: data[p.name].reshape(p.byte_shape), False)
    tokens = list(range(3, 40))
    a = moestream.load(src, device="cpu", progress=False).logits(tokens)
    b = moestream.load(dst, device="cpu", progress=False).logits(tokens)
    assert torch.equal(a, b)


def test_token_ids_out_of_range(model_file):
    engine = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    with pytest.raises(MoestreamError, match="token ids must be in"):
        engine.logits([1, 2, 1280])
    engine.close()


def test_a_pass_that_fails_half_way_retires_its_cache(model_file):
    """Some layers' KV (or recurrent) state already advanced: reusing the cache would be silently wrong."""
    engine = moestream.load(model_file("tiny-qwen35moe", "F32"), device="cpu", progress=False)
    cache = engine.new_cache()
    layer = engine.model.layer

    def fail_in_layer_2(il, *args):
        if il == 2:
            raise KeyboardInterrupt
        return layer(il, *args)

    engine.model.layer = fail_in_layer_2
    with pytest.raises(KeyboardInterrupt):
        engine.forward([1, 2, 3], cache)
    engine.model.layer = layer
    with pytest.raises(MoestreamError, match="half-updated"):
        engine.forward([4], cache)
    engine.close()


def test_a_bad_reconfigure_keeps_the_engine_working(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_cpu_moe=1)
    before = engine.logits([5, 6, 7])
    with pytest.raises(MoestreamError, match="--n-cpu-moe -1"):
        engine.setup.reconfigure(n_cpu_moe=-1)
    assert engine.options.placement.n_cpu_moe == 1
    with pytest.raises(MoestreamError, match="chosen at load"):  # the model holds its delta rule
        engine.setup.reconfigure(deltanet="torch")
    assert torch.equal(engine.logits([5, 6, 7]), before)
    engine.close()
    with pytest.raises(MoestreamError, match="closed"):
        engine.logits([5])


def test_loading_the_engine_does_not_import_torch_dynamo():
    """torch._dynamo costs seconds at start-up (torch.nn.attention.bias pulled it in)."""
    code = "import sys, moestream.runtime.loader, moestream.cli.main; print('torch._dynamo' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("device", "n_cpu_moe", "small_batch", "cpu_layers", "builds"),
    [
        ("cpu", 0, "auto", 0, True),  # the CPU device's quantized weights go through it
        ("cuda", 0, "auto", 0, False),  # all resident on a GPU: never used
        ("cuda", 26, "auto", 0, True),  # auto times the cpu way
        ("cuda", 26, "gather", 0, False),
        ("cuda", 26, "gather", 4, True),
    ],
)
def test_the_c_matvec_builds_ahead_only_where_it_may_run(device, n_cpu_moe, small_batch, cpu_layers, builds):
    from types import SimpleNamespace as NS

    from moestream.runtime import loader

    opts = NS(
        model=NS(torch_device=torch.device(device)),
        placement=NS(n_cpu_moe=n_cpu_moe),
        decode=NS(small_batch=small_batch, cpu_layers=cpu_layers),
    )
    assert loader._may_use_cpu_matvec(opts) is builds
