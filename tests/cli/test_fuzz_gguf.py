"""Fuzz: damaged GGUF files, metadata, tokenizers and chat templates each end in exit 2 and one line naming the
cause, fast and without growing memory, never a traceback. Deterministic: every mutation is listed here."""

from __future__ import annotations

import resource
import struct
import time

import gguf
import pytest
import torch
from test_errors import rewrite

import moestream
from moestream.cli.main import main
from moestream.formats.gguf import GGUFFile

SECONDS = 10
RSS_GROWTH_KIB = 1 << 20  # 1 GiB over the peak before the case


def kv_offsets(path: str, key: str) -> tuple[int, int]:
    """(start of key's value type field, start of its value) in the file."""
    r = gguf.GGUFReader(path)
    field = r.fields[key]
    at = field.offset + 8 + len(key.encode())
    return at, at + 4


def tensor_info_offset(path: str, index: int) -> tuple[int, int]:
    """(offset of tensor index's n_dims field, its number of dimensions)."""
    r = gguf.GGUFReader(path)
    t = r.tensors[index]
    return t.field.offset + 8 + len(t.name.encode()), len(t.shape)


def patched(src: str, dst, *edits: tuple[int, str, object], truncate: int | None = None) -> str:
    data = bytearray(open(src, "rb").read())
    for at, fmt, value in edits:
        struct.pack_into(fmt, data, at, value)
    if truncate is not None:
        data = data[:truncate]
    open(dst, "wb").write(bytes(data))
    return str(dst)


def emptied(src: str, dst, key: str) -> str:
    """A copy whose metadata array `key` has no entries (gguf's writer refuses to write one)."""
    r = gguf.GGUFReader(src)
    field, last = r.fields[key], r.tensors[-1].field
    items_at = field.offset + 8 + len(key.encode()) + 4 + 4 + 8  # key, value type, element type, count
    end = field.offset + sum(int(p.nbytes) for p in field.parts)
    header_end = last.offset + sum(int(p.nbytes) for p in last.parts)
    data = open(src, "rb").read()
    head = bytearray(data[:items_at] + data[end:header_end])
    struct.pack_into("<Q", head, items_at - 8, 0)
    head += bytes(-len(head) % 32)  # the default alignment
    open(dst, "wb").write(bytes(head) + data[r.data_offset :])
    return str(dst)


def raw_cases(src: str, tmp) -> dict[str, tuple[str, str]]:
    """name -> (file, word the error line must hold): byte-level damage of the header and layout."""
    count_at = kv_offsets(src, "tokenizer.ggml.tokens")[1] + 4  # after the array's element type
    dims_at, n_dims = tensor_info_offset(src, 1)
    type_at = dims_at + 4 + 8 * n_dims
    offset_at = type_at + 4
    r = gguf.GGUFReader(src)
    first_offset = int(r.tensors[0].data_offset - r.data_offset)
    size = len(open(src, "rb").read())
    p = lambda name, *edits, **kw: str(patched(src, tmp / f"{name}.gguf", *edits, **kw))  # noqa: E731
    return {
        "tensor count 2^60": (p("nt", (8, "<Q", 1 << 60)), "tensor count"),
        "metadata count 2^60": (p("nkv", (16, "<Q", 1 << 60)), "metadata count"),
        "string array 2^40 long": (p("arr", (count_at, "<Q", 1 << 40)), "tokenizer.ggml.tokens"),
        "version 7": (p("ver", (4, "<I", 7)), "version"),
        "0 dimensions": (p("d0", (dims_at, "<I", 0)), "dimensions"),
        "5 dimensions": (p("d5", (dims_at, "<I", 5)), "dimensions"),
        "dimension 0": (p("dz", (dims_at + 4, "<Q", 0)), "from 1"),
        "dimension 2^62": (p("dbig", (dims_at + 4, "<Q", 1 << 62)), "2^62"),
        # one count too low: the walk reads on into the next section (data read from the wrong bytes ran)
        "tensor count one lower": (p("nt1", (8, "<Q", len(r.tensors) - 1)), "tensor count"),
        "metadata count one lower": (p("nkv1", (16, "<Q", len(r.fields) - 4)), "metadata count"),
        "unknown tensor type": (p("ty", (type_at, "<I", 99)), "type id 99"),
        "misaligned offset": (p("mis", (offset_at, "<Q", first_offset + 1 + 1000)), "data offset"),
        "overlapping data": (p("ovl", (offset_at, "<Q", first_offset)), "data offset"),
        "truncated": (p("cut", truncate=size - 1000), "truncated"),
        "header cut short": (p("hdr", truncate=200), "remain"),
    }


def meta_cases(src: str, src35: str, tmp) -> dict[str, tuple[str, str]]:
    """name -> (file, word): metadata values of the wrong type or range, layout and tokenizer problems."""
    with GGUFFile(src) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
        types = list(f.metadata["tokenizer.ggml.token_type"])

    def m(name: str, changes: dict, base: str = src, **kw) -> str:
        return rewrite(base, tmp / f"{name}.gguf", changes, **kw)

    q = "qwen3moe."
    return {
        "block_count 2^32-1": (m("bc", {q + "block_count": 2**32 - 1}), "block_count"),
        "block_count 1.5": (m("bcf", {q + "block_count": 1.5}), "block_count"),
        "block_count inf": (m("bci", {q + "block_count": float("inf")}), "block_count"),
        "expert_count a string": (m("ec", {q + "expert_count": "many"}), "expert_count"),
        "negative context length": (m("ctx", {q + "context_length": -5}), "context_length"),
        "odd head size": (m("hd", {q + "attention.key_length": 33}), "even"),
        "zero conv kernel": (m("ck", {"qwen35moe.ssm.conv_kernel": 0}, src35), "conv_kernel"),
        "alignment 3": (m("al", {"general.alignment": 3}), "alignment"),
        "extra tensor": (m("ex", {q + "block_count": 1}), "not part of"),
        "tokens stored as integers": (m("ti", {"tokenizer.ggml.tokens": list(range(len(tokens)))}), "tokens"),
        "bos id a string": (m("bos", {"tokenizer.ggml.bos_token_id": "1"}), "bos_token_id"),
        "fewer tokens than rows": (
            m("few", {"tokenizer.ggml.tokens": tokens[:-8], "tokenizer.ggml.token_type": types[:-8]}),
            "rows",
        ),
        "malformed merge": (m("mg", {"tokenizer.ggml.merges": ["a b", "abc"]}), "merges"),
        "token type 99": (m("tt", {"tokenizer.ggml.token_type": [99, *types[1:]]}), "token_type[0] = 99"),
        "no merges": (emptied(src, tmp / "mg0.gguf", "tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
        "pre-tokenizer a list": (m("pre", {"tokenizer.ggml.pre": ["qwen2"]}), "tokenizer.ggml.pre must be text"),
    }


TEMPLATES = {  # name -> (template, word of the error)
    "loops 10^15": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "CPU",
    ),
    "string times 10^10": ("{{ 'x' * 10**10 }}", "memory"),
    "range 10^9": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "loop over a long string twice": (
        "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "CPU",
    ),
    "string doubled by ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "memory",
    ),
    "string doubled by replace": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('x', 'xx') %}{% endfor %}",
        "memory",
    ),
    "ljust 10^10": ("{{ 'a'.ljust(10**10) }}", "memory"),
    "center 10^10": ("{{ 'a'|center(10**10) }}", "memory"),
    "format width 10^10": ("{{ '{:>10000000000}'.format('a') }}", "memory"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    "syntax error": ("{% for %}", "does not compile"),
    "raises": ("{{ raise_exception('no system role') }}", "no system role"),
    "not text": (12345, "tokenizer.chat_template must be text"),
}


def check(argv: list[str], word: str, capsys) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    code = main(argv)
    took = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("moestream: error:")]
    assert code == 2 and len(errors) == 1 and not any("Traceback" in line for line in err), err
    assert word in errors[0], errors[0]
    assert took < SECONDS, f"{took:.1f} s"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < RSS_GROWTH_KIB


@pytest.fixture(scope="module")
def cases(model_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    src, src35 = model_file("tiny", "Q4_K_M"), model_file("tiny-qwen35moe", "Q4_K_M")
    out = raw_cases(src, tmp) | meta_cases(src, src35, tmp)
    for name, (template, word) in TEMPLATES.items():
        path = rewrite(src, tmp / f"t{len(out)}.gguf", {"tokenizer.chat_template": template})
        out["template: " + name] = (path, word)
    return out


NAMES = (  # every case by name, so each is its own test id
    "tensor count 2^60,metadata count 2^60,string array 2^40 long,version 7,0 dimensions,5 dimensions,"
    "dimension 0,dimension 2^62,tensor count one lower,metadata count one lower,unknown tensor type,"
    "misaligned offset,overlapping data,truncated,header cut short,"
    "block_count 2^32-1,block_count 1.5,block_count inf,expert_count a string,negative context length,"
    "odd head size,zero conv kernel,alignment 3,extra tensor,tokens stored as integers,bos id a string,"
    "fewer tokens than rows,malformed merge,token type 99,no merges,pre-tokenizer a list"
).split(",") + ["template: " + n for n in TEMPLATES]


@pytest.mark.parametrize("name", NAMES)
def test_damaged_input_is_one_clear_line(cases, capsys, name):
    path, word = cases[name]
    argv = ["run", "-m", path, "-p", "hi", "-n", "1", "--device", "cpu"]
    check(argv + (["--chat"] if name.startswith("template") else []), word, capsys)


def test_a_4d_norm_loads_like_a_vector(model_file, tmp_path):
    """llama.cpp accepts a norm stored as [256, 1, 1, 1]; so do we, with the same logits."""
    src = model_file("tiny", "F32")
    with GGUFFile(src) as f:
        name = "blk.0.attn_norm.weight"
        n = f.tensors[name].shape[0]
    dst = rewrite(src, tmp_path / "4d.gguf", reshape=(name, (1, 1, 1, n)))
    tokens = list(range(3, 30))
    a = moestream.load(src, device="cpu", progress=False)
    b = moestream.load(dst, device="cpu", progress=False)
    try:
        assert torch.equal(a.logits(tokens), b.logits(tokens))
    finally:
        a.close()
        b.close()


def test_a_fifo_is_not_a_missing_file(tmp_path, capsys):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    check(["info", str(fifo)], "not a regular file", capsys)
