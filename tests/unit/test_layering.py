"""The import direction, read from the source as an import-linter contract would:

    trainer_hooks  ->  ckptd (core)  ->  storage_backends
                         ^
    ckptd.cli  ->  ckptd.server

* ``storage_backends`` imports neither ``ckptd`` nor ``trainer_hooks``;
* nothing under ``ckptd`` imports ``trainer_hooks``;
* ckptd's core (every module but ``ckptd.server`` and ``ckptd.cli``) imports neither of those
  two edges; ``ckptd.server`` does not import ``ckptd.cli``;
* ``trainer_hooks`` uses ckptd's core only (the daemon is reached over HTTP, never imported);
* no private name (``_x``, or anything in a ``_x`` module) is imported from another package:
  what a package shares is public;
* no import cycle between ckptd modules (a cycle means neither module can be read, tested or
  split without the other; the last one ran commit -> catalog -> verify -> commit). Importing
  the package a module belongs to (``from ckptd import __version__``) is no edge: Python
  imports a module's packages before the module anyway.

Every ``import`` statement counts, wherever it is: at module level, inside a function (a lazy
import is still a dependency), under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("storage_backends", "ckptd", "trainer_hooks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in ``source``; relative
    imports are resolved against ``module``; ``from a import b`` yields ``a.b`` (b may be a
    submodule)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base


def layer(name: str) -> str | None:
    """The layer a module belongs to, or None for anything outside the project."""
    top = name.split(".")[0]
    if top not in PACKAGES:
        return None
    if top == "ckptd":
        for edge in ("ckptd.server", "ckptd.cli"):
            if name == edge or name.startswith(edge + "."):
                return edge
        return "ckptd"
    return top


# layer -> the project layers it may import (itself included)
ALLOWED = {
    "storage_backends": {"storage_backends"},
    "ckptd": {"ckptd", "storage_backends"},
    "ckptd.server": {"ckptd.server", "ckptd", "storage_backends"},
    "ckptd.cli": {"ckptd.cli", "ckptd.server", "ckptd", "storage_backends"},
    "trainer_hooks": {"trainer_hooks", "ckptd", "storage_backends"},
}


def private_across(importer: str, target: str) -> bool:
    """``target`` is private to a package other than ``importer``'s."""
    if target.split(".")[0] not in PACKAGES or target.split(".")[0] == importer.split(".")[0]:
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in target.split("."))


def violations() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            mod = module_name(path)
            here = layer(mod)
            for line, target in imports(path.read_text(), mod, path.name == "__init__.py"):
                there = layer(target)
                if there is not None and there not in ALLOWED[here]:
                    out.append(f"{path.relative_to(REPO)}:{line}: {here} imports {target} ({there})")
                if private_across(mod, target):
                    out.append(f"{path.relative_to(REPO)}:{line}: {mod} imports {target}, private to its package")
    return out


def import_graph(pkg: str = "ckptd") -> dict[str, set[str]]:
    """module -> the modules of ``pkg`` it imports (each import statement, lazy ones included,
    resolved to the longest module name it starts with), without edges to its own packages."""
    paths = {module_name(p): p for p in sorted((REPO / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        edges = graph.setdefault(mod, set())
        for _, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            parts = target.split(".")
            hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in paths), None)
            if hit is None or hit == mod or mod.startswith(hit + "."):
                continue
            edges.add(hit)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_ckptd_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_lazy_cycle():
    graph = {"ckptd.commit": {"ckptd.catalog"}, "ckptd.catalog": {"ckptd.verify"}, "ckptd.verify": {"ckptd.commit"}}
    assert cycles(graph) == [["ckptd.catalog", "ckptd.commit", "ckptd.verify"]]
    assert cycles({**graph, "ckptd.verify": set()}) == []
    lazy = "def f():\n    from ckptd.verify import read_record\n"
    assert [t for _, t in imports(lazy, "ckptd.catalog", False)] == ["ckptd.verify.read_record"]


def test_imports_point_one_way():
    assert violations() == []


def test_every_package_is_scanned():
    for pkg in PACKAGES:
        assert len(list((REPO / pkg).rglob("*.py"))) > 3, pkg


SAMPLE = """
import os
from storage_backends import open_store

def lazy():
    from trainer_hooks.flatten import as_numpy
    import ckptd.server.app

if TYPE_CHECKING:
    from .codec import ArrayLayout
from ..errors import CheckpointError
"""


def test_the_parser_sees_lazy_relative_and_type_checking_imports():
    got = [t for _, t in sorted(imports(SAMPLE, "ckptd.interop.common", is_package=False))]
    assert got == [
        "os",
        "storage_backends.open_store",
        "trainer_hooks.flatten.as_numpy",
        "ckptd.server.app",
        "ckptd.interop.codec.ArrayLayout",
        "ckptd.errors.CheckpointError",
    ]
    assert [layer(t) for t in got] == [None, "storage_backends", "trainer_hooks", "ckptd.server", "ckptd", "ckptd"]


@pytest.mark.parametrize(
    ("importer", "target", "ok"),
    [
        ("ckptd.stream", "trainer_hooks.flatten", False),
        ("ckptd.server.jobs", "trainer_hooks.writer", False),
        ("storage_backends.local", "ckptd.errors", False),
        ("ckptd.commit", "ckptd.server.jobs", False),
        ("trainer_hooks.checkpointer", "ckptd.server.app", False),
        ("ckptd.server.app", "ckptd.cli.main", False),
        ("ckptd.cli.serve", "ckptd.server.app", True),
        ("trainer_hooks.snapshot", "ckptd.savejob", True),
        ("ckptd.server.handoff", "ckptd.savejob", True),
    ],
)
def test_the_contract(importer, target, ok):
    assert (layer(target) in ALLOWED[layer(importer)]) is ok


def test_private_names_stay_in_their_package():
    assert private_across("trainer_hooks.snapshot", "storage_backends._direct.DIRECT_MIN_BYTES")
    assert private_across("ckptd.stream", "trainer_hooks.flatten._copy_into")
    assert not private_across("storage_backends.local", "storage_backends._direct.open_direct")
    assert not private_across("trainer_hooks.hf", "trainer_hooks._callback_common.hook_for")
    assert not private_across("ckptd.reshard", "ckptd.layout.interval_grid")
    assert not private_across("trainer_hooks.writer", "__future__.annotations")
