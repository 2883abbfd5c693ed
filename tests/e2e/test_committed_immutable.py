"""A committed checkpoint is immutable on every write path: a new save (a fresh Checkpointer,
so nothing in memory knows the step), ``CheckpointWriter`` and ``ckptd import`` all refuse a
step that has ``commit.json`` before writing a byte. (The daemon's path:
``tests/server/test_commit_rules.py``.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd import catalog, errors
from ckptd.cli.main import main
from ckptd.stream import CheckpointWriter
from ckptd.verify import verify
from storage_backends import open_store
from trainer_hooks import Checkpointer


def folder_digest(root: Path, step: int) -> dict[str, tuple[str, int]]:
    base = root / f"step_{step:010d}"
    return {
        str(p.relative_to(base)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in base.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def committed(tmp_path):
    root = tmp_path / "job"
    with Checkpointer(str(root)) as ck:
        ck.save(3, {"w": torch.ones(8, 8)}).result()
    return root, folder_digest(root, 3)


def test_a_new_checkpointer_cannot_overwrite_a_committed_step(committed):
    root, before = committed
    with Checkpointer(str(root)) as ck:  # another process's view: nothing in memory about step 3
        fut = ck.save(3, {"w": torch.full((8, 8), 5.0)})
        exc = fut.exception(timeout=120)
        assert isinstance(exc, errors.AlreadyCommitted) and "already committed" in str(exc)
        ck.save(4, {"w": torch.full((8, 8), 5.0)}).result()  # the job goes on with the next step
    assert folder_digest(root, 3) == before
    store = open_store(str(root))
    assert verify(store, 3).ok
    got = {"w": torch.zeros(8, 8)}
    with Checkpointer(str(root)) as ck:
        ck.restore(got, step=3)
    assert torch.equal(got["w"], torch.ones(8, 8))


def test_checkpoint_writer_refuses_a_committed_step(committed):
    root, before = committed
    store = open_store(str(root))
    with pytest.raises(errors.AlreadyCommitted, match="already committed"), CheckpointWriter(store, 3) as w:
        w.write_tensor("w", np.zeros((8, 8), np.float32))
    assert folder_digest(root, 3) == before


def test_import_refuses_a_committed_step(committed, tmp_path, capsys):
    root, before = committed
    torch.save({"w": torch.zeros(8, 8)}, tmp_path / "sd.pt")
    rc = main(["import", str(tmp_path / "sd.pt"), "--format", "torch", str(root), "--step", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "already committed" in err and "Traceback" not in err, err
    assert folder_digest(root, 3) == before
    assert catalog.committed_steps(open_store(str(root))) == [3]
