"""Models are plain math: no file under moestream/models/ imports a kernel or the offload layer (they call
moestream.ops, which picks kernels). Every import counts, at any depth, including inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moestream"
FORBIDDEN = ("moestream.kernels", "moestream.offload")


def forbidden_imports(path: Path, package: tuple[str, ...] = ("models",)) -> list[str]:
    """'file:line: module' for each import of a kernel or offload module in the file at path, a module of
    moestream.<package> (which relative imports start from)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, or levels above it
                anchor = package[: len(package) - node.level + 1]
                module = ".".join(["moestream", *anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names] if module == "moestream" else [module]
        else:
            continue
        hits = [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
        found += [f"{path.name}:{node.lineno}: {n}" for n in hits]
    return found


def test_models_import_no_kernel_and_no_offload() -> None:
    files = sorted((PACKAGE / "models").rglob("*.py"))
    assert files, f"no model files under {PACKAGE / 'models'}"
    found = [hit for p in files for hit in forbidden_imports(p, p.relative_to(PACKAGE).parent.parts)]
    assert not found, "model files must call moestream.ops, not kernels or offload:\n" + "\n".join(found)


def test_the_check_sees_every_form(tmp_path: Path) -> None:
    """Plain, from-, package-level, relative and late imports are all seen; ops and models pass."""
    p = tmp_path / "m.py"
    p.write_text(
        "import moestream.kernels.fused\nfrom moestream import offload\nfrom ..kernels import qmatvec\n"
        "from moestream.ops.norm import rms_norm\nfrom . import layers\n\n"
        "def f():\n    from moestream.offload.dense import DenseWeights\n"
    )
    assert forbidden_imports(p) == [
        "m.py:1: moestream.kernels.fused",
        "m.py:2: moestream.offload",
        "m.py:3: moestream.kernels",
        "m.py:8: moestream.offload.dense",
    ]
