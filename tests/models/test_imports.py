"""Models are plain math: no file under moestream/models/ imports a kernel or the offload layer (they call
moestream.ops, which picks kernels). Every import counts, at any depth, including inside functions: the walk
is the layering test's."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import PACKAGE, imported

FORBIDDEN = ("kernels", "offload")


def forbidden_imports(root: Path = PACKAGE) -> list[str]:
    """'file:line: models imports layer' for each kernel or offload import under root/models."""
    found = []
    for path in sorted((root / "models").rglob("*.py")):
        rel = path.relative_to(root)
        for line, layer in imported(ast.parse(path.read_text(), str(path)), rel.parts[:-1]):
            if layer in FORBIDDEN:
                found.append(f"{rel}:{line}: models imports {layer}")
    return found


def test_models_import_no_kernel_and_no_offload() -> None:
    assert (PACKAGE / "models" / "qwen3moe.py").exists()
    found = forbidden_imports()
    assert not found, "model files must call moestream.ops, not kernels or offload:\n" + "\n".join(found)


def test_the_check_sees_kernels_beside_the_layers_below(tmp_path: Path) -> None:
    """Kernels rank below models, so the layering test lets them through; this one does not. ops passes."""
    (tmp_path / "models" / "sub").mkdir(parents=True)
    (tmp_path / "models" / "m.py").write_text(
        "from moestream.ops.norm import rms_norm\nfrom ..kernels import qmatvec\n\n"
        "def f():\n    from moestream.offload.dense import DenseWeights\n"
    )
    (tmp_path / "models" / "sub" / "n.py").write_text("import moestream.kernels.fused\nfrom .. import layers\n")
    assert forbidden_imports(tmp_path) == [
        "models/m.py:2: models imports kernels",
        "models/m.py:5: models imports offload",
        "models/sub/n.py:1: models imports kernels",
    ]
