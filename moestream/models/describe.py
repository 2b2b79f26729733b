"""An open GGUF file checked against its architecture's layout: the ModelSpec its metadata gives, every tensor
present in the shape that spec expects, of a type moestream reads; and what its routed experts weigh. No torch:
`info` reports from this alone, the loader builds on it."""

from __future__ import annotations

import dataclasses
import warnings
from types import ModuleType

from moestream.errors import MoestreamError
from moestream.formats import quants
from moestream.formats.gguf import GGUFFile
from moestream.models.registry import layout
from moestream.models.spec import ModelSpec


def describe(f: GGUFFile) -> tuple[ModuleType, ModelSpec]:
    """The architecture's layout module and the ModelSpec of an open file, with every expected tensor checked."""
    arch = layout(f.architecture, f.path)
    n_vocab = f.tensor("token_embd.weight").shape[0]
    try:
        spec = arch.read_spec(f.metadata, n_vocab)
    except (ValueError, TypeError) as e:  # a count that is no number, a list where a number belongs...
        raise MoestreamError(f"{f.path}: model metadata is malformed ({e}); the file is damaged") from None
    expected = arch.tensor_shapes(spec, tied_output="output.weight" not in f.tensors)
    optional = getattr(arch, "OPTIONAL", ())  # a layer's tensors the file may lack (llama.cpp: not required)
    for name, shape in expected.items():
        if name not in f.tensors and (layer_part(name) in optional or _block(name) >= spec.n_layer):
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


def layer_part(name: str) -> str:
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


def expert_bytes_per_layer(f: GGUFFile, spec: ModelSpec) -> list[int]:
    """Stored bytes of each layer's routed experts; 0 for a layer without (a leading dense one)."""
    arch = layout(f.architecture, f.path)
    sizes = [0] * spec.n_layer
    for il in spec.expert_layers:
        sizes[il] = sum(f.tensor(n).nbytes for n in arch.expert_tensor_names(il))
    return sizes
