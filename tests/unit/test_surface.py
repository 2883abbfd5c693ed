"""The declared surface: every public module (no ``_`` in its path) of the three packages lists
its names in ``__all__``, every listed name exists, and a package uses from another package only
names that the other declares. Read from the source (ast), so optional extras need not be
installed. The user-facing names of the public contract are exported by the packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_layering import PACKAGES, REPO, imports, module_name


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


MODULES = _modules()


def _public(name: str) -> bool:
    return not any(p.startswith("_") for p in name.split("."))


def declared(path: Path) -> list[str] | None:
    """The literal ``__all__`` of a module, or None."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def defined(path: Path) -> set[str]:
    """Top-level names a module binds (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("module", [m for m in MODULES if _public(m)])
def test_every_public_module_declares_its_names(module):
    path = MODULES[module]
    names = declared(path)
    if names is None:
        assert not [n for n in defined(path) if not n.startswith("_")] or path.name == "__init__.py", (
            f"{module} has no __all__"
        )
        return
    assert len(set(names)) == len(names), f"{module}: __all__ repeats a name"
    missing = set(names) - defined(path)
    assert not missing, f"{module}: __all__ lists undefined {sorted(missing)}"


def test_packages_use_only_what_other_packages_declare():
    bad = []
    for module, path in MODULES.items():
        for line, target in imports(path.read_text(), module, path.name == "__init__.py"):
            top = target.split(".")[0]
            if top not in PACKAGES or top == module.split(".")[0] or target in MODULES:
                continue  # outside the project, the same package, or a whole module
            base, _, name = target.rpartition(".")
            names = declared(MODULES[base]) if base in MODULES else None
            if names is None or name not in names:
                bad.append(f"{path.relative_to(REPO)}:{line}: {target} is not in {base}.__all__")
    assert bad == []


def test_the_contract_names_are_exported():
    assert {"Checkpointer", "CheckpointHook", "ElasticSampler", "CheckpointError"} <= set(
        declared(MODULES["trainer_hooks"])
    )
    assert {"open_store", "Store", "StorageError"} <= set(declared(MODULES["storage_backends"]))
