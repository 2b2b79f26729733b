"""`moestream info`: the tensor types of a file (count and bytes), and a warning for each type that has no fast
path on the device."""

from __future__ import annotations

from collections import Counter

import pytest

from moestream.cli.main import main
from moestream.formats.gguf import GGUFFile
from moestream.kernels import types


def info(capsys, path: str, *flags: str) -> tuple[list[str], list[str]]:
    assert main(["info", path, *flags]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), err.splitlines()


@pytest.mark.parametrize("preset", ["tiny-qwen35moe", "tiny-glm4moe"])  # glm4moe: a NextN block counts too
def test_each_type_with_its_tensors_and_bytes(model_file, capsys, preset):
    path = model_file(preset, "Q3_K_M")
    out, _ = info(capsys, path, "--device", "cpu")
    assert "file type     Q3_K_M (general.file_type 12)" in out
    start = next(i for i, line in enumerate(out) if line.startswith("tensor types"))
    rows = [line[14:].split() for line in out[start:] if line[:14].strip() in ("", "tensor types")]
    with GGUFFile(path) as f:
        count = Counter(t.qtype.name for t in f.tensors.values())
        size = Counter()
        for t in f.tensors.values():
            size[t.qtype.name] += t.nbytes
    assert {r[0]: int(r[1]) for r in rows} == dict(count)
    assert [r[0] for r in rows] == [q for q, _ in size.most_common()]  # largest first


@pytest.mark.parametrize("quant", ["Q4_K_M", "IQ2_XXS", "IQ4_XS", "MXFP4_MOE"])
def test_each_expert_type_without_the_cpu_dot_is_named_with_its_tensors(model_file, capsys, quant):
    """On the CPU only expert stacks want a kernel (the CPU dot, for experts computed on the host): a type
    that lacks it gets one warning naming its tensors; a type that has it, none."""
    path = model_file("tiny-qwen35moe", quant)
    _, err = info(capsys, path, "--device", "cpu")
    with GGUFFile(path) as f:
        experts = [(n, t.qtype) for n, t in f.tensors.items() if "_exps." in n]
    want = []
    for qtype in dict.fromkeys(q for _, q in experts):
        if types.missing(qtype, "cpu"):
            names = [n for n, q in experts if q == qtype]
            listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            want.append(
                f"moestream: warning: {qtype.name} has no CPU dot for experts computed on the CPU (--small-batch "
                f"cpu): they are dequantized in torch, then multiplied ({len(names)} tensors: {listed})"
            )
    assert err == want
