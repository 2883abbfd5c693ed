"""Items 7 and 8 on a local job root: links out of the root and special files.

The attacker can write into the job root (a shared filesystem, a bucket mirrored to disk) but
not elsewhere; each attack tries to make ckptd read, write or delete outside the root, hang on a
FIFO, or exhaust memory through a link to ``/dev/zero``."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from ckptd.errors import CheckpointError
from storage_backends import StorageError
from tests.security.conftest import assert_one_line_error, cli, make_root, small_state
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(180)


def _snapshot(folder):
    return sorted((p.relative_to(folder).as_posix(), p.read_bytes()) for p in folder.rglob("*") if p.is_file())


def test_save_never_writes_or_deletes_through_a_linked_step_folder(tmp_path):
    root = make_root(tmp_path / "job", steps=(1,))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_text("precious")  # looks like a stale partial checkpoint
    (outside / "zarr.json").write_text("precious too")
    before = _snapshot(outside)
    os.symlink(outside, root / "step_0000000002")
    ckpt = Checkpointer(str(root))
    try:
        with pytest.raises((CheckpointError, StorageError)):
            ckpt.save(2, small_state(2)).result()
    finally:
        ckpt.close()
    assert _snapshot(outside) == before


def test_show_and_restore_never_read_through_a_linked_step_folder(tmp_path):
    root = make_root(tmp_path / "job", steps=(1,))
    # A complete committed checkpoint outside the root, linked in as a newer step.
    other = make_root(tmp_path / "other", steps=(3,))
    os.symlink(other / "step_0000000003", root / "step_0000000003")
    p = cli("ls", root, "--json")
    assert p.returncode == 0 and '"step": 3' not in p.stdout, p.stdout
    assert_one_line_error(cli("show", root, "--step", 3), rc=(1,))
    state = {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "meta": {"epoch": -1}}
    ckpt = Checkpointer(str(root))
    try:
        assert ckpt.restore(state) == 1  # the latest of *this* root
        with pytest.raises(CheckpointError):
            ckpt.restore(state, step=3)
    finally:
        ckpt.close()


def test_linked_files_inside_a_step_are_not_read(tmp_path):
    root = make_root(tmp_path / "job", steps=(1,))
    step = root / "step_0000000001"
    secret = tmp_path / "secret.json"
    shutil.copy(step / "manifest.json", secret)
    os.unlink(step / "manifest.json")
    os.symlink(secret, step / "manifest.json")
    line = assert_one_line_error(cli("show", root), rc=(1,))
    assert "manifest" in line


def test_fifo_and_dev_zero_do_not_hang_or_exhaust_memory(tmp_path):
    root = make_root(tmp_path / "job", steps=(1, 2))
    s1, s2 = root / "step_0000000001", root / "step_0000000002"
    os.unlink(s1 / "manifest.json")
    os.mkfifo(s1 / "manifest.json")
    os.unlink(s2 / "manifest.json")
    os.symlink("/dev/zero", s2 / "manifest.json")
    chunk = next(p for p in s2.rglob("c/*") if p.is_file())
    os.unlink(chunk)
    os.mkfifo(chunk)
    for argv in (("show", root, "--step", 1), ("verify", root, "--step", 1), ("show", root), ("verify", root)):
        p = cli(*argv, timeout=60, limit_mb=1024)
        assert_one_line_error(p, rc=(1,))
    p = cli("ls", root, timeout=60, limit_mb=1024)
    assert p.returncode == 0 and "Traceback" not in p.stderr
    # Nobody ever opened the FIFOs for reading: a writer would block; prove it with a timeout.
    done = threading.Event()

    def writer():
        try:
            fd = os.open(s1 / "manifest.json", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            done.set()  # ENXIO: no reader has it open

    writer()
    assert done.is_set()
