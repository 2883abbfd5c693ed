"""The docs name only code that exists: every ``ckptd/...``, ``trainer_hooks/...`` and
``storage_backends/...`` path in README.md and docs/*.md is a file or folder of the repository,
every dotted ``ckptd.x.y`` name imports (module, then attributes), and every bare ``name.py``
of docs/architecture.md's tables is a module of the three packages (or of tests/, benchmarks/:
test helpers live there)."""

from __future__ import annotations

import importlib
import importlib.util
import re

from tests.docs.docblocks import REPO

PACKAGES = ("ckptd", "trainer_hooks", "storage_backends")
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:ckptd|trainer_hooks|storage_backends)/[\w/.-]*\w)")
DOTTED = re.compile(r"`((?:ckptd|trainer_hooks|storage_backends)(?:\.[A-Za-z_]\w*)+)(?![\w*])")  # not a glob (open_*)
FILE_SUFFIXES = {"sock", "json", "yaml", "service", "md", "py", "png"}
BARE = re.compile(r"`(_?[a-z][\w]*\.py)`")


def _mentions(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        for n, line in enumerate((REPO / doc).read_text().splitlines(), 1):
            found += [(doc, n, m.group(1)) for m in pattern.finditer(line)]
    return found


def test_every_module_path_named_exists():
    missing = [f"{d}:{n}: {p}" for d, n, p in _mentions(PATH) if not (REPO / p).exists()]
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:k]))
        except ImportError:  # a parent that needs an optional dependency (horovod) exists
            return True
        if spec is not None:
            break
    else:
        return False
    if k == len(parts):
        return True
    try:
        obj = importlib.import_module(".".join(parts[:k]))
    except ImportError:  # exists, needs an optional dependency (trainer_hooks.horovod)
        return True
    for attr in parts[k:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_every_dotted_name_imports():
    missing = [
        f"{d}:{n}: {name}"
        for d, n, name in _mentions(DOTTED)
        if name.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not _resolves(name)
    ]
    assert not missing, "the docs name modules or attributes that do not exist:\n" + "\n".join(missing)


def test_architecture_names_existing_modules():
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = {p.name for top in (*PACKAGES, "tests", "benchmarks") for p in (REPO / top).rglob("*.py")}
    missing = sorted({m for m in BARE.findall(text) if m not in modules})
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_docs_speak_to_users():
    """No work-tracking references ("issue 29 item 4") in what users read."""
    tracking = re.compile(r"\b(issues? #?\d+|items? \d+(-\d+)?|issue-\d+)", re.I)
    found = [
        f"{d}:{n}: {line.strip()}"
        for d in [*DOCS, "deploy/README.md"]
        for n, line in enumerate((REPO / d).read_text().splitlines(), 1)
        if tracking.search(line)
    ]
    assert not found, "\n".join(found)
