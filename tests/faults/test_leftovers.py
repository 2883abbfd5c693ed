"""Killed saves leave temp files and folders; gc removes all of it and says exactly what it
removed; ls shows no empty ghosts (issue 14, item 4). Real trainer processes, SIGKILL, a real
``ckptd`` process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import load
from tests.faults.campaign import Campaign, Root, kill
from tests.faults.common import STEP_DIR, all_files, cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _wait_for_temp_files(folder: Path, proc, timeout: float = 120) -> list[str]:
    deadline = load.deadline(timeout)
    while time.monotonic() < deadline:
        temps = [f for f in all_files(folder) if ".tmp." in f]
        if temps:
            return temps
        assert proc.is_alive(), "the trainer died before writing"
        time.sleep(0.02)
    raise AssertionError(f"no temp file appeared under {folder}")


def _files_and_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return len(files), sum(p.stat().st_size for p in files)


def test_gc_removes_everything_a_killed_save_left_and_reports_it(tmp_path):
    camp = Campaign(tmp_path / "work")
    root = Root(str(tmp_path / "job"), {})
    assert camp.run_trainer(root, 1)[-1] == "done"  # step 1 committed

    # step 2: every file sits as a complete temp file for 30 s before its rename; kill it then
    p, _ = camp.trainer(root, 1, slow_rename_s=30.0, hang=True)
    step2 = Path(root.uri) / STEP_DIR.format(2)
    temps = _wait_for_temp_files(step2, p)
    time.sleep(0.3)  # the other I/O threads' temp files too
    kill(p)
    assert temps and all(".tmp." in t for t in temps)

    # ls: no "0 B" ghost: a step folder holding only temp files is not a checkpoint
    rows = json.loads(cli("ls", root.uri, "--json").stdout)
    assert [r["step"] for r in rows if r["committed"]] == [1]
    assert all(r["bytes"] for r in rows if not r["committed"])

    root.next_step = 3
    assert camp.run_trainer(root, 1)[-1] == "done"  # the job goes on: step 3 committed
    expect = [_files_and_bytes(Path(root.uri) / STEP_DIR.format(s)) for s in (1, 2)]

    out = cli("gc", root.uri, "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["deleted"] == [1, 2] and doc["kept"] == [3] and doc["left_behind"] == []
    assert doc["deleted_objects"] == sum(n for n, _ in expect)
    assert doc["deleted_bytes"] == sum(b for _, b in expect)
    assert not step2.exists() and not (Path(root.uri) / STEP_DIR.format(1)).exists()
    # the root's own records (``_latest``, ...) aside, only step 3 is left
    assert sorted(p.name for p in Path(root.uri).iterdir() if not p.name.startswith("_")) == [STEP_DIR.format(3)]

    out = cli("gc", root.uri, "--keep-last", "1")
    assert out.returncode == 0 and out.stdout == "" and "nothing to delete" in out.stderr


def test_temp_files_of_a_killed_attempt_are_gone_after_the_resave(tmp_path):
    camp = Campaign(tmp_path / "work")
    root = Root(str(tmp_path / "job"), {"TORCHELASTIC_RUN_ID": "leftovers-job"})  # a restart keeps its job id
    assert camp.run_trainer(root, 1)[-1] == "done"
    p, _ = camp.trainer(root, 1, slow_rename_s=30.0, hang=True)
    step2 = Path(root.uri) / STEP_DIR.format(2)
    _wait_for_temp_files(step2, p)
    kill(p)
    root.next_step = 2  # the restarted job saves step 2 again
    lines = camp.run_trainer(root, 1)
    assert lines[-1] == "done" and lines[-2].startswith("ok 2 "), lines
    # The fenced begin does not purge the step (other ranks may be writing already); the writer
    # that commits it sweeps the dead attempt's temp files right after the commit, no gc needed.
    assert [f for f in all_files(step2) if ".tmp." in f] == []
    camp.check(root)  # gc --abort-uploads-older-than 0 included


def test_gc_removes_temp_files_a_killed_writer_left_inside_a_committed_step(tmp_path):
    """A writer killed between writing a temp file and renaming it into a committed step (as a
    daemon killed inside ``put_if_absent`` of ``commit.json`` leaves one): gc's sweep of
    incomplete writes removes it once older than the threshold, never the step's objects."""
    import subprocess
    import sys

    camp = Campaign(tmp_path / "work")
    root = Root(str(tmp_path / "job"), {})
    assert camp.run_trainer(root, 1)[-1] == "done"
    step1 = Path(root.uri) / STEP_DIR.format(1)
    before = all_files(step1)
    # a real process, a real kill: its rename is slowed (an injected slow disk) so the temp
    # file is complete on disk when the SIGKILL lands
    code = (
        "import os, time, sys\n"
        "from storage_backends.local import LocalStore\n"
        "real = os.replace\n"
        "os.replace = lambda *a, **k: (open(sys.argv[2], 'w').close(), time.sleep(600), real(*a, **k))\n"
        "LocalStore(sys.argv[1]).put('step_0000000001/_verify.json', b'{}' * 1000)\n"
    )
    flag = tmp_path / "written"
    p = subprocess.Popen([sys.executable, "-c", code, root.uri, str(flag)], cwd=str(Path(__file__).parents[2]))
    try:
        deadline = load.deadline(120)
        while not flag.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        kill(p)
    temps = [f for f in all_files(step1) if ".tmp." in f]
    assert len(temps) == 1

    out = cli("gc", root.uri, "--keep-last", "1", "--json")  # default: only older than 24 h
    assert out.returncode == 0 and json.loads(out.stdout)["aborted_uploads"] == []
    out = cli("gc", root.uri, "--keep-last", "1", "--abort-uploads-older-than", "0", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["aborted_uploads"] == [f"{STEP_DIR.format(1)}/{temps[0]}"]
    assert all_files(step1) == before
    camp.check(root)
