"""Issue 27 items 2 and 4: ``_latest/`` and the quarantine copy, written by someone who may
write the job root.

The chain of ``ckptd.latest`` is a hint: tampering with it may cost a listing, never a wrong or
failed restore, and never a failed save. Every record ckptd reads has a cap, so a 1.5 GiB sparse
file where a record belongs is one clear error (or an ignored hint) at a bounded RSS. Each test
goes through the real ``Checkpointer`` and the real ``ckptd`` CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ckptd.errors import CheckpointError
from tests.security.conftest import REPO, assert_one_line_error, cli, env, make_root, small_state
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(180)

SPARSE = 3 << 29  # 1.5 GiB of holes: costs no disk, but a reader that reads it whole holds it
RSS_MB = 600  # the CLI with torch imported stays well under this; reading 1.5 GiB does not


def _restore(root) -> int:
    state = {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "meta": {"epoch": -1}}
    ckpt = Checkpointer(str(root))
    try:
        step = ckpt.restore(state)
        assert state["meta"]["epoch"] == step  # the bytes of that step, not another's
        assert ckpt.latest_step() == step
        return step
    finally:
        ckpt.close()


def _save(root, step: int) -> None:
    ckpt = Checkpointer(str(root))
    try:
        ckpt.save(step, small_state(step)).result()
    finally:
        ckpt.close()


def _ls_steps(root) -> list[int]:
    p = cli("ls", root, "--json")
    assert p.returncode == 0, p.stderr
    return [c["step"] for c in json.loads(p.stdout) if c["committed"]]


def _peak_rss_mb(*argv) -> tuple[subprocess.CompletedProcess, float]:
    """``ckptd ARGV`` in a fresh process; its peak RSS in MiB (printed by the process itself)."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['ckptd', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('ckptd.cli.main', run_name='__main__')\n"
        "finally:\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of a large
        # pytest process reports the parent's size (seen in the full suite: 998 MiB)
        "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "    print(f'PEAK_RSS_KB {hwm}', file=sys.stderr)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        cwd=str(REPO),
    )
    kb = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("PEAK_RSS_KB")]
    assert kb, p.stderr
    print(f"peak RSS of ckptd {' '.join(map(str, argv[:1]))}: {kb[0] / 1024:.0f} MiB")
    return p, kb[0] / 1024


def test_a_hint_above_ten_digits_is_ignored_and_later_saves_move_it(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2, 3))
    (root / "_latest" / "hint.json").write_text("99999999999")  # 11 digits: no step folder has it
    assert _restore(root) == 3
    _save(root, 4)
    assert _restore(root) == 4
    assert json.loads((root / "_latest" / "hint.json").read_text()) == 4  # the save repaired it
    assert _ls_steps(root) == [1, 2, 3, 4]


def test_a_forged_hint_far_above_the_chain_does_not_stop_saves_from_linking(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    (root / "_latest" / "hint.json").write_text("9999999999")  # a valid step, never committed
    assert _restore(root) == 2  # costs a listing
    _save(root, 3)
    assert json.loads((root / "_latest" / "after_0000000002.json").read_text()) == 3
    assert json.loads((root / "_latest" / "hint.json").read_text()) == 3
    assert _restore(root) == 3


@pytest.mark.parametrize("which", ["hint.json", "after_0000000001.json", "first.json"])
def test_deeply_nested_values_fail_neither_restore_nor_save(tmp_path, which):
    root = make_root(tmp_path / "job", steps=(1, 2))
    if which != "hint.json":
        os.unlink(root / "_latest" / "hint.json")  # so that the walk reads the links
    path = root / "_latest" / which
    if path.exists():
        os.unlink(path)  # links are written once: the attacker deletes and replaces
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert _restore(root) == 2
    _save(root, 3)
    assert _restore(root) == 3
    assert _ls_steps(root) == [1, 2, 3]


def test_a_dropped_link_and_a_hint_pointed_back_do_not_roll_restore_back(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2, 3))
    os.unlink(root / "_latest" / "after_0000000002.json")  # the link 2 -> 3
    (root / "_latest" / "hint.json").write_text("2")
    assert _ls_steps(root) == [1, 2, 3]
    assert _restore(root) == 3  # not 2: step 3 is committed
    p = cli("show", root, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["step"] == 3, p.stdout + p.stderr
    _save(root, 4)
    assert _restore(root) == 4


def test_a_rewritten_link_to_an_older_committed_step_does_not_roll_restore_back(tmp_path):
    # Without delete rights: step 3 was saved again below the chain's end (not linked), so it
    # has no link after it; pointing the hint at it must not hide 4.
    root = make_root(tmp_path / "job", steps=(1, 2, 4))
    _save(root, 3)
    assert not (root / "_latest" / "after_0000000003.json").exists()
    (root / "_latest" / "hint.json").write_text("3")
    assert _restore(root) == 4


def test_a_sparse_hint_of_1_5_gib_is_ignored_at_a_bounded_rss(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    hint = root / "_latest" / "hint.json"
    with open(hint, "r+b") as f:
        f.truncate(SPARSE)
    p, rss = _peak_rss_mb("show", root, "--json")
    assert p.returncode == 0 and json.loads(p.stdout.strip())["step"] == 2, p.stderr[-2000:]
    assert rss < RSS_MB
    assert _restore(root) == 2
    _save(root, 3)  # the save's link ignores it too, and replaces it
    assert _restore(root) == 3 and hint.stat().st_size < 100


def test_a_sparse_commit_record_in_quarantine_is_one_clear_error_at_a_bounded_rss(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    assert cli("quarantine", root, "--step", 2, "--reason", "test").returncode == 0
    (copy,) = (root / "_quarantine").iterdir()
    with open(copy / "commit.json", "r+b") as f:
        f.truncate(SPARSE)
    p, rss = _peak_rss_mb("unquarantine", root, "--step", 2)
    line = assert_one_line_error(p, rc=(1,))
    assert "commit.json" in line and "more than" in line, line
    assert rss < RSS_MB
    assert not (root / "step_0000000002" / "commit.json").exists()  # nothing installed
    assert _restore(root) == 1


def test_a_quarantined_commit_record_that_is_not_json_is_refused(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    assert cli("quarantine", root, "--step", 2).returncode == 0
    (copy,) = (root / "_quarantine").iterdir()
    (copy / "commit.json").write_text("[" * 100_000)
    line = assert_one_line_error(cli("unquarantine", root, "--step", 2), rc=(1,))
    assert "not valid JSON" in line, line
    assert not (root / "step_0000000002" / "commit.json").exists()
    shutil.rmtree(root / "step_0000000002", ignore_errors=True)
    assert _restore(root) == 1


def test_a_sparse_safetensors_index_is_refused_by_its_cap(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    with open(src / "model.safetensors.index.json", "wb") as f:
        f.truncate(SPARSE)
    p, rss = _peak_rss_mb("import", src, "--format", "safetensors", tmp_path / "job", "--step", 1)
    line = assert_one_line_error(p, rc=(1,))
    assert "safetensors index" in line and "more than" in line, line
    assert rss < RSS_MB


def test_a_sparse_ray_pointer_is_refused_by_its_cap(tmp_path):
    ray_train = pytest.importorskip("ray.train")
    from trainer_hooks.ray import CKPTD_CHECKPOINT_FILE, ckptd_step

    with open(tmp_path / CKPTD_CHECKPOINT_FILE, "wb") as f:
        f.truncate(SPARSE)
    with pytest.raises(CheckpointError, match="more than"):
        ckptd_step(ray_train.Checkpoint.from_directory(str(tmp_path)))
    (tmp_path / CKPTD_CHECKPOINT_FILE).write_text('{"root": "/r", "step": 3}')
    assert ckptd_step(ray_train.Checkpoint.from_directory(str(tmp_path))) == ("/r", 3)
