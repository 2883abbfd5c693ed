"""Item 10: only ``step_`` + exactly ten ASCII digits names a checkpoint folder.

Before the fix an empty ``step_00000000003`` (eleven digits) parsed as step 3, became the
"newest" step for retention, and ``gc --keep-last 2`` deleted committed step 2."""

from __future__ import annotations

from ckptd import catalog
from ckptd.manifest import parse_step_dir
from storage_backends import open_store
from tests.security.conftest import cli, make_root

BOGUS = ["step_00000000003", "step_000000000\u0663", "step_12345678901234567890123456789012345678901"]


def test_gc_ignores_overlong_and_unicode_step_names(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    for name in BOGUS:
        (root / name).mkdir()
        (root / name / "commit.json").write_text('{"step": 3}')
    p = cli("gc", root, "--keep-last", "2")
    assert p.returncode == 0, p.stderr
    with open_store(str(root)) as store:
        assert catalog.committed_steps(store) == [1, 2]
    for name in BOGUS:  # never deleted either: not ours
        assert (root / name / "commit.json").exists()

    p = cli("ls", root)
    assert p.returncode == 0, p.stderr
    for name in BOGUS:
        assert f"ignored: {name}" in p.stderr
        assert name not in p.stdout
    p = cli("ls", root, "--json")
    assert p.returncode == 0 and [r["step"] for r in __import__("json").loads(p.stdout)] == [1, 2]


def test_parse_step_dir_is_exact():
    assert parse_step_dir("step_0000000007") == 7
    assert parse_step_dir("step_0000000007/") == 7
    for name in [*BOGUS, "step_000000007", "step_0000000007x", "xstep_0000000007", "step_\uff10" * 1]:
        assert parse_step_dir(name) is None, name
