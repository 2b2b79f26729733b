"""Generated models in each of llama.cpp's recipes: the logits of the same weights dequantized to F32 by gguf's
reference, every streaming schedule the resident run's tokens, and a file that says how it was made."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import threadpoolctl
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile
from moestream.formats.quantize import QUANTIZABLE
from moestream.formats.writer import TensorPlan, write_gguf
from moestream.offload.device import CpuDevice
from moestream.runtime.sampling import SamplingParams
from moestream.tools.presets import get_preset
from moestream.tools.recipes import RECIPES, recipe
from moestream.tools.synthetic import _worker_pool, make_model, tensor_plans

Q = gguf.GGMLQuantizationType
TOKENS = torch.randint(0, 1280, (40,), generator=torch.Generator().manual_seed(7)).tolist()


def made(model_file, tmp_path, preset: str, quant: str) -> str:
    """The generated file; a recipe whose types have no quantizer yet is refused, naming them, and skips."""
    lacking = sorted(
        {p.qtype.name for p in tensor_plans(get_preset(preset), recipe(quant)) if p.qtype not in QUANTIZABLE}
    )
    if lacking:
        with pytest.raises(MoestreamError, match=f"cannot write {', '.join(lacking)} blocks yet"):
            make_model(tmp_path / "refused.gguf", get_preset(preset), quant=quant, progress=False)
        pytest.skip(f"{quant} waits on a quantizer for {', '.join(lacking)}")
    return model_file(preset, quant)


def dequantized_copy(path: str, out) -> str:
    """The file with every tensor dequantized to F32 by gguf.quants (the reference), metadata unchanged."""
    with GGUFFile(path) as f:
        plans = [TensorPlan(n, Q.F32, t.shape) for n, t in f.tensors.items()]

        def produce(p: TensorPlan) -> np.ndarray:
            t = f.tensors[p.name]
            floats = gguf.quants.dequantize(t.data, t.qtype).astype(np.float32)
            return floats.reshape(-1).view(np.uint8).reshape(p.byte_shape)

        write_gguf(out, f.architecture, f.metadata, plans, produce, progress=False)
    return str(out)


def logits(path: str, **opts) -> torch.Tensor:
    engine = moestream.load(path, device="cpu", progress=False, **opts)
    try:
        return engine.logits(TOKENS)
    finally:
        engine.close()


@pytest.mark.parametrize("quant", RECIPES)
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-gpt-oss", "tiny-glm4moe"])
def test_logits_are_those_of_the_weights_dequantized(model_file, tmp_path, one_thread, preset, quant):
    path = made(model_file, tmp_path, preset, quant)
    ours, ref = logits(path), logits(dequantized_copy(path, tmp_path / "f32.gguf"))
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, f"{preset} {quant}: max |logit difference| {err:.2e} of the largest logit"


@pytest.mark.parametrize("quant", RECIPES)
def test_every_schedule_and_way_gives_the_resident_tokens(model_file, tmp_path, one_thread, quant):
    """3 of 4 layers streamed: prefill bit for bit under each schedule; decode's tokens under each small-batch way."""
    path = made(model_file, tmp_path, "tiny-qwen35moe", quant)
    params = SamplingParams(max_tokens=4, stop_at_eos=False)

    def run(**opts) -> tuple[torch.Tensor, list[int]]:
        engine = moestream.load(path, device="cpu", ubatch=16, stream_min_batch=8, progress=False, **opts)
        try:
            return engine.logits(TOKENS), engine.generate(TOKENS[:12], params).tokens
        finally:
            engine.close()

    resident, tokens = run(n_cpu_moe=0)
    for stream in ("serial", "pinned", "overlap", "layer-major"):
        streamed, streamed_tokens = run(n_cpu_moe=3, stream=stream, slots=2, device_impl=CpuDevice(copy_delay_s=0.001))
        assert torch.equal(streamed, resident), f"{quant} --stream {stream}: {(streamed - resident).abs().max():.2e}"
        assert streamed_tokens == tokens, f"{quant} --stream {stream}"
    for way in ("cpu", "gather"):  # the streamed runs' decode took auto's upload
        assert run(n_cpu_moe="all", small_batch=way)[1] == tokens, f"{quant} --small-batch {way}"


def test_the_file_says_how_it_was_made(model_file):
    with GGUFFile(model_file("tiny", "Q4_K_M")) as f:
        meta = f.metadata
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    text = meta["general.description"]
    assert "random weights" in text and "llama.cpp's Q4_K_M recipe" in text and "no importance matrix" in text
    plans = {p.name: p.qtype for p in tensor_plans(get_preset("tiny"), recipe("Q4_K_M"))}
    assert plans["output.weight"] == Q.Q6_K and plans["blk.0.ffn_gate_exps.weight"] == Q.Q4_K


def test_a_recipe_name_in_any_case(model_file, tmp_path):
    make_model(tmp_path / "m.gguf", get_preset("tiny"), quant="q8_0", progress=False)
    with GGUFFile(tmp_path / "m.gguf") as f:
        assert f.metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
        assert {t.qtype for t in f.tensors.values()} == {Q.Q8_0, Q.F32}


def test_the_head_favours_real_tokens_so_generated_text_shows(model_file):
    """Padding tokens (the vocabulary past the tokenizer's real ones) decode to nothing: a head that sampled them
    printed a blank line. Their rows are zero; the real ones still random."""
    from moestream.formats.tokenizer import UNUSED

    path = model_file("tiny", "F32")
    with GGUFFile(path) as f:
        real = list(f.metadata["tokenizer.ggml.token_type"]).index(UNUSED)
        head = np.array(f.tensors["output.weight"].data).view(np.float32).reshape(f.tensors["output.weight"].shape)
        assert real < head.shape[0] and not head[real:].any() and (head[:real] != 0).all(axis=1).all()
    e = moestream.load(path, device="cpu", progress=False)
    try:
        greedy = e.generate("The", SamplingParams(max_tokens=16, stop_at_eos=False))
        sampled = e.generate("The", SamplingParams(max_tokens=64, temperature=1.0, seed=0, stop_at_eos=False))
    finally:
        e.close()
    assert all(t < real for t in greedy.tokens) and greedy.text.strip()
    assert sum(t < real for t in sampled.tokens) > 0.8 * len(sampled.tokens)


def test_uniform_routing_writes_the_weights_it_always_did(tmp_path):
    """--routing uniform is the generator as it was before trained routing existed: the same tensors, bit for bit
    (a hash of every tensor's name and bytes as main wrote them then; the metadata, the chat template with it,
    may grow)."""
    out = tmp_path / "u.gguf"
    make_model(out, get_preset("tiny-qwen35moe"), quant="Q4_K_M", progress=False, routing="uniform")
    digest = hashlib.sha256()
    for t in gguf.GGUFReader(out).tensors:
        digest.update(t.name.encode())
        digest.update(np.ascontiguousarray(t.data).tobytes())
    assert digest.hexdigest() == "0fb32a16c4eedf21af4dcb20d70da6b59572fcbd4d76db1aa109fa22c2c8518a"


def test_trained_routing_needs_a_preset_with_its_settings(tmp_path):
    with pytest.raises(MoestreamError, match="tiny has no trained routing settings.*qwen3-30b-a3b"):
        make_model(tmp_path / "t.gguf", get_preset("tiny"), progress=False, routing="trained")


def _blas_threads() -> list[int]:
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]


def test_a_writers_worker_keeps_to_one_blas_thread():
    """A worker a core: a worker's own BLAS threads would contend with the others' (the planted rows' products)."""
    pool = _worker_pool(2)
    try:
        inside = pool.apply(_blas_threads)
        assert inside and set(inside) == {1}, inside
    finally:
        pool.close()
        pool.join()
