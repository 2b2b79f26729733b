"""Imports flow one way: formats -> models -> offload -> runtime -> serving -> the CLI, with kernels beside
formats and profiling beside models. A module may import its own package and any lower layer, never a higher
one; every `moestream.X` import counts, including those inside functions (they are how arrows sneak back up)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"

LAYERS = {
    "errors": -1,  # moestream/errors.py: the one error type, under everything
    "formats": 0,
    "kernels": 0,
    "ops": 0.5,  # between kernels and models: a model's operations, each picking a kernel or torch
    "models": 1,
    "profiling": 1,
    "offload": 2,
    "runtime": 3,
    "serving": 4,
    "cli": 5,  # the top-level cli*.py and moestream/__init__.py (the public API)
}
# imports within one rank that are allowed, besides a package's own modules
BESIDE = {"kernels": {"formats"}, "profiling": {"formats", "kernels", "models"}}


def file_layer(rel: Path) -> str:
    """The layer of the module at moestream/<rel>."""
    if len(rel.parts) > 1:
        return rel.parts[0]
    if rel.stem == "errors":
        return "errors"
    assert rel.stem.startswith("cli") or rel.stem == "__init__", f"{rel}: a top-level module with no layer"
    return "cli"


def target_layer(name: str) -> str:
    """The layer of an imported module moestream[.<name>...]: a subpackage, errors, or else the top (the CLI
    modules and the public API of moestream/__init__.py)."""
    first = name.split(".")[1] if "." in name else ""
    return first if first in LAYERS else "cli"


def imported(tree: ast.AST, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, layer) of every moestream import, at any depth, of a module in moestream/<package>/."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, or levels above it
                anchor = package[: len(package) - node.level + 1]
                module = ".".join(["moestream", *anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from moestream import x`: x is a subpackage, a module or a name of the public API
            names = [f"{module}.{a.name}" for a in node.names] if module == "moestream" else [module]
        else:
            continue
        out += [(node.lineno, target_layer(n)) for n in names if n == "moestream" or n.startswith("moestream.")]
    return out


def violations(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted([*root.glob("*.py"), *root.glob("*/*.py")]):
        rel = path.relative_to(root)
        here = file_layer(rel)
        assert here in LAYERS, f"{rel}: package {here!r} is not in LAYERS; give it a place in the order"
        for line, there in imported(ast.parse(path.read_text(), str(path)), rel.parts[:-1]):
            if there == here or LAYERS[there] < LAYERS[here] or there in BESIDE.get(here, ()):
                continue
            found.append(f"{rel}:{line}: {here} imports {there}")
    return found


def test_imports_flow_one_way() -> None:
    found = violations()
    assert not found, "imports from a higher layer:\n" + "\n".join(found)


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The walk finds a late import back up, relative ones and the public API, and lets allowed side arrows
    through."""
    (tmp_path / "profiling").mkdir()
    (tmp_path / "profiling" / "probe.py").write_text(
        "from moestream.models import layers\n\ndef f():\n    from moestream.offload.host import PinnedRanges\n"
    )
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text(
        "from moestream.formats import quants\nimport moestream.models.spec\nfrom . import dequant\n"
        "from ..runtime import engine\nimport moestream\n"
    )
    assert violations(tmp_path) == [
        "kernels/k.py:2: kernels imports models",
        "kernels/k.py:4: kernels imports runtime",
        "kernels/k.py:5: kernels imports cli",
        "profiling/probe.py:4: profiling imports offload",
    ]
