"""Packages import downward (DESIGN.md's layers): no package of ``megatron/`` imports one that
imports it, nor one above it, and no module holds two ideas' worth of lines.

Read from the source (every ``import megatron...`` and ``from megatron... import``, at module
level or inside a function alike), so a cycle shows whatever runs first.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megatron"
# Top to bottom; a package may import those below it and those of its own layer.
LAYERS = [
    {"interop", "inference"},
    {"training"},
    {"checkpoint"},
    {"launch"},
    {"estimate"},
    {"models", "data", "optim"},
    {"parallel"},
    {"config"},
    {"ground"},  # errors.py, logging.py, atomic_file.py
]
MAX_LINES = 400


def _package(module: str) -> str:
    """``megatron.checkpoint.save`` -> ``checkpoint``; a top-level module -> ``ground``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else "ground"


def imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files where it happens."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        source = _package(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith("megatron.") and _package(name) != source:
                    found.setdefault((source, _package(name)), []).append(str(rel))
    return found


def test_every_package_is_in_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages | {"ground"} == set().union(*LAYERS)


def test_packages_import_downward():
    level = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    edges = imports()
    cycles = [(a, b, edges[a, b][0]) for a, b in edges if (b, a) in edges]
    assert not cycles, f"packages importing each other (package, package, where): {cycles}"
    upward = [(a, b, files[0]) for (a, b), files in edges.items() if level[b] < level[a]]
    assert not upward, f"packages importing a package above them: {upward}"


def test_no_module_is_past_the_size_of_one_idea():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"split these along their ideas: {long}"
