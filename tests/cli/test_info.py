"""`moestream info`: the tensor types of a file (count and bytes), a warning for each type that has no fast path on
the device, and all of it without importing torch (seconds) on the CPU."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest
from gguf import GGMLQuantizationType

from moestream.cli.main import main
from moestream.formats import quants
from moestream.formats.gguf import GGUFFile
from moestream.options import cuda_available


def info(capsys, path: str, *flags: str) -> tuple[list[str], list[str]]:
    assert main(["info", path, *flags]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), [line for line in err.splitlines() if not line.startswith("moestream: info: ")]


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


def test_a_type_without_the_cpu_dot_is_named_with_its_expert_tensors(model_file, capsys, monkeypatch):
    # Every supported type has its kernels (tests/kernels/test_types.py): Q3_K's CPU dot is taken away here
    q3_k = quants.TYPES[GGMLQuantizationType.Q3_K]
    monkeypatch.setitem(quants.TYPES, q3_k.qtype, dataclasses.replace(q3_k, cpu_dot=None))
    path = model_file("tiny-qwen35moe", "Q3_K_M")  # gate and up experts in Q3_K
    _, err = info(capsys, path, "--device", "cpu")
    with GGUFFile(path) as f:
        q3 = [n for n, t in f.tensors.items() if t.qtype.name == "Q3_K" and "_exps." in n]
    assert err == [
        "moestream: warning: Q3_K has no CPU dot for experts computed on the CPU (--small-batch cpu): they are "
        f"dequantized in torch, then multiplied ({len(q3)} tensors: {', '.join(q3[:3])} and {len(q3) - 3} more)"
    ]


def test_no_warning_where_every_type_has_its_kernels(model_file, capsys):
    _, err = info(capsys, model_file("tiny", "Q4_K_M"), "--device", "cpu")  # experts in Q4_K and Q6_K
    assert err == []


NO_TORCH = """
import sys
from moestream.cli.main import main
assert main(["info", *sys.argv[1:]]) == 0
assert "torch" not in sys.modules, "info imported torch"
"""


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-gpt-oss", "tiny-glm4moe"])
def test_info_on_the_cpu_imports_no_torch(model_file, preset):
    """Each architecture's layout, the type registry and the CPU's kernel list are read without torch."""
    path = model_file(preset, "Q4_K_M")
    r = subprocess.run([sys.executable, "-c", NO_TORCH, path, "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "experts" in r.stdout and "Traceback" not in r.stderr


def test_the_device_check_is_torchs_answer():
    """info's auto device asks torch only where an NVIDIA driver is (options.cuda_available): the answer is torch's on a
    machine with a GPU as without."""
    import torch

    assert cuda_available() == torch.cuda.is_available()
