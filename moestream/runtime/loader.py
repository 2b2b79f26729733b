"""Build an Engine from a GGUF file: check every tensor, put weights where they go, attach the tokenizer."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from moestream.errors import MoestreamError
from moestream.formats import quants
from moestream.formats.gguf import GGUFFile
from moestream.kernels.gather import RowGather
from moestream.models.registry import architecture
from moestream.models.spec import ModelSpec
from moestream.offload.builder import build_offload, check_expert_counts
from moestream.offload.dense import DenseWeights
from moestream.offload.device import cap_vram
from moestream.offload.embedding import HostEmbedding
from moestream.offload.small_batch import Measured
from moestream.options import Options, parse_size
from moestream.runtime.engine import Engine
from moestream.runtime.setup import Setup


def describe(f: GGUFFile):
    """The architecture module and ModelSpec of an open file, with every expected tensor checked."""
    arch = architecture(f.architecture, f.path)
    n_vocab = f.tensor("token_embd.weight").shape[0]
    try:
        spec = arch.read_spec(f.metadata, n_vocab)
    except (ValueError, TypeError) as e:  # a count that is no number, a list where a number belongs...
        raise MoestreamError(f"{f.path}: model metadata is malformed ({e}); the file is damaged") from None
    expected = arch.tensor_shapes(spec, tied_output="output.weight" not in f.tensors)
    optional = getattr(arch, "OPTIONAL", ())  # a layer's tensors the file may lack (llama.cpp: not required)
    for name, shape in expected.items():
        if name not in f.tensors and (_layer_part(name) in optional or _block(name) >= spec.n_layer):
            continue  # an absent optional tensor, or a NextN block left out (a trunk-only conversion)
        t = f.tensor(name)  # a missing tensor is a named error
        if _squeezed(t.shape) != _squeezed(shape):  # {n, 1}, {n} and {n, 1, 1, 1} are the same tensor
            raise MoestreamError(
                f"{f.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} from the metadata; "
                "the file is damaged or its metadata disagrees with its weights"
            )
        if t.shape != shape:  # read it in the shape the model uses
            f.tensors[name] = dataclasses.replace(t, shape=shape, data=t.data.reshape(*shape[:-1], -1))
        if t.qtype not in quants.SUPPORTED:
            raise MoestreamError(
                f"{f.path}: tensor {name} has type {t.qtype.name}, which moestream cannot dequantize "
                f"(supported: {', '.join(sorted(q.name for q in quants.SUPPORTED))}); requantize the model"
            )
    extra = [name for name in f.tensors if name not in expected]
    if extra:
        raise MoestreamError(
            f"{f.path}: {len(extra)} tensors are not part of a {spec.arch} model of {spec.n_layer} layers (first: "
            f"{extra[0]}); the metadata and the weights disagree (llama.cpp refuses such a file too)"
        )
    _skip_nextn(f, spec)
    return arch, spec


def _block(name: str) -> int:
    """The block index of a `blk.N.*` tensor, -1 for the others."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1


def _layer_part(name: str) -> str:
    """`attn_q.bias` of `blk.3.attn_q.bias`."""
    return name.split(".", 2)[2] if _block(name) >= 0 else name


def _skip_nextn(f: GGUFFile, spec: ModelSpec) -> None:
    """The NextN / MTP blocks after the trunk (their shapes checked above) leave the file's tensor map, so no
    layer loads them: moestream runs the trunk (llama.cpp too, unless asked to draft tokens with them)."""
    nextn = [name for name in f.tensors if _block(name) >= spec.n_layer]
    for name in nextn:
        del f.tensors[name]
    if spec.n_layer_nextn:
        warnings.warn(
            f"{f.path}: skipping {spec.n_layer_nextn} NextN (multi-token prediction) layer(s) after the "
            f"{spec.n_layer}-layer trunk ({len(nextn)} tensors): moestream runs the trunk and drafts no tokens",
            stacklevel=3,
        )


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


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
    f = GGUFFile(path)
    try:
        arch, spec = describe(f)
        check_expert_counts(opts, spec)
        tokenizer = load_tokenizer(f)
        if before_weights is not None:
            before_weights(tokenizer, opts.model.context(spec.n_ctx_train), spec)
        device, dtype = opts.model.torch_device, opts.model.torch_dtype
        host = {n for il in spec.expert_layers for n in arch.expert_tensor_names(il)} | {"token_embd.weight"}
        dense = {name: t for name, t in f.tensors.items() if name not in host}
        if "output.weight" not in dense:  # tied: the head reads the embedding matrix, so it goes to the device
            dense["output.weight"] = f.tensor("token_embd.weight")
        # before the first upload: dense weights count too
        cap_vram(device, parse_size(opts.placement.vram_budget), opts.placement.expandable_segments)
        exact = getattr(arch, "FLOAT32", ())  # a layer's tensors the model reads in float32 whatever the dtype
        float32 = frozenset(name for name in dense if _layer_part(name) in exact)
        weights = DenseWeights(dense, device, dtype, progress=opts.model.progress, float32=float32)
        dense_bytes = weights.nbytes

        pick = RowGather()  # the engine's expert picker: every placement it builds shares its kernel failure

        def build(o: Options, measured: Measured | None = None):
            return build_offload(f, arch, spec, o, dense_bytes, device_impl, pick, measured)

        embedding = HostEmbedding(f.tensor("token_embd.weight"), device, dtype)
        model = arch.Model(spec, weights, embedding, opts.model)
        engine = Engine(model, tokenizer, Setup(model, opts, build), source=f)
    except BaseException:
        f.close()
        raise
    try:
        engine.setup.settle()
    except BaseException:
        engine.close()  # its placement and the file with it
        raise
    return engine


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


def expert_bytes_per_layer(f: GGUFFile, spec: ModelSpec) -> list[int]:
    """Stored bytes of each layer's routed experts; 0 for a layer without (a leading dense one)."""
    arch = architecture(f.architecture, f.path)
    sizes = [0] * spec.n_layer
    for il in spec.expert_layers:
        sizes[il] = sum(f.tensor(n).nbytes for n in arch.expert_tensor_names(il))
    return sizes
