"""Build an Engine from a GGUF file: check every tensor, put weights where they go, attach the tokenizer."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile
from moestream.kernels import cpu_quant
from moestream.kernels.gather import RowGather
from moestream.models.describe import describe, layer_part
from moestream.models.registry import architecture
from moestream.offload.builder import build_offload, check_expert_counts
from moestream.offload.dense import DenseWeights
from moestream.offload.device import cap_vram
from moestream.offload.embedding import HostEmbedding
from moestream.offload.small_batch import Measured
from moestream.options import Options, parse_size
from moestream.runtime import way_memory
from moestream.runtime.engine import Engine
from moestream.runtime.setup import Setup


def load(
    path: str | os.PathLike[str],
    options: Options | None = None,
    device_impl=None,
    before_weights: Callable[[Any, int, Any], None] | None = None,
    **flat: Any,
) -> Engine:
    """Open a GGUF MoE model and return an Engine ready to generate.

    device_impl replaces the copy/compute device (tests pass a CpuDevice with injected delays).
    before_weights(tokenizer, n_ctx, spec) runs once the metadata is read and before any weight moves, so a
    caller can refuse a prompt that cannot fit, or options for this model's shapes, without waiting for the upload.
    """
    opts = Options.make(**flat) if options is None else options.replace(**flat)
    if opts.model.threads is not None:
        torch.set_num_threads(opts.model.threads)
    if _may_use_cpu_matvec(opts):
        cpu_quant.build_in_background()  # a fresh machine compiles it while the file loads
    f = GGUFFile(path)
    try:
        layout, spec = describe(f)  # the file's layout (tensor names), checked
        module = architecture(spec.arch)  # the model module: Model, state_bytes and the math
        check_expert_counts(opts, spec)
        tokenizer = load_tokenizer(f)
        if before_weights is not None:
            before_weights(tokenizer, opts.model.context(spec.n_ctx_train), spec)
        device, dtype = opts.model.torch_device, opts.model.torch_dtype
        host = {n for il in spec.expert_layers for n in layout.expert_tensor_names(il)} | {"token_embd.weight"}
        dense = {name: t for name, t in f.tensors.items() if name not in host}
        if "output.weight" not in dense:  # tied: the head reads the embedding matrix, so it goes to the device
            dense["output.weight"] = f.tensor("token_embd.weight")
        # before the first upload: dense weights count too
        cap_vram(device, parse_size(opts.placement.vram_budget), opts.placement.expandable_segments)
        exact = getattr(module, "FLOAT32", ())  # a layer's tensors the model reads in float32 whatever the dtype
        float32 = frozenset(name for name in dense if layer_part(name) in exact)
        weights = DenseWeights(dense, device, dtype, progress=opts.model.progress, float32=float32)
        dense_bytes = weights.nbytes

        state_bytes = module.state_bytes(spec)
        pick = RowGather()  # the engine's expert picker: every placement it builds shares its kernel failure

        def build(o: Options, measured: Measured | None = None):
            return build_offload(f, spec, state_bytes, o, dense_bytes, device_impl, pick, measured)

        embedding = HostEmbedding(f.tensor("token_embd.weight"), device, dtype)
        model = module.Model(spec, weights, embedding, opts.model)
        engine = Engine(model, tokenizer, Setup(model, opts, build, way_memory.file_identity(f.path)), source=f)
    except BaseException:
        f.close()
        raise
    try:
        engine.setup.settle()
    except BaseException:
        engine.close()  # its placement and the file with it
        raise
    return engine


def _may_use_cpu_matvec(opts: Options) -> bool:
    """Whether this load may compute with the C matvec: on the CPU device, or streamed layers whose small batches
    may run on the CPU (--small-batch auto tries it, cpu and --cpu-layers use it)."""
    d = opts.decode
    streams = opts.placement.n_cpu_moe != 0
    return opts.model.torch_device.type == "cpu" or (streams and (d.small_batch in ("auto", "cpu") or d.cpu_layers > 0))


def load_tokenizer(f: GGUFFile):
    """The file's tokenizer, or None when it carries none (then only token ids work)."""
    if "tokenizer.ggml.tokens" not in f.metadata:
        return None
    from moestream.formats.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_metadata(f.metadata)
    rows = f.tensor("token_embd.weight").shape[0]
    if tokenizer.vocab_size != rows:  # llama.cpp sizes the embedding by the vocabulary and refuses a mismatch
        raise MoestreamError(
            f"{f.path}: the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight has {rows} rows; "
            "the file is damaged or was assembled from different models"
        )
    return tokenizer
