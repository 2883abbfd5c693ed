"""A short disk-full episode must not wedge the job: on a real small tmpfs, a save that hits
ENOSPC fails its future, deletes what it wrote, and once space returns the next save commits,
even with ``keep_last=1`` (which never deletes partial steps newer than the newest commit)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.verify import verify
from storage_backends import open_store
from trainer_hooks import Checkpointer

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 9 MiB tmpfs (two checkpoints and a little), mounted for the test (we are root in CI);
    skipped only if mounting is not permitted here."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def state(value: float) -> dict:
    # 8 tensors of 512 KiB: 4 MiB of data per checkpoint
    return {"t": {f"w{i}": torch.full((128, 1024), value + i) for i in range(8)}}


def test_disk_full_episode_then_space_returns(small_disk, monkeypatch):
    monkeypatch.setenv("CKPTD_IO_THREADS", "1")  # one put at a time: ENOSPC hits after whole shards
    root = str(small_disk / "job")
    ck = Checkpointer(root, keep_last=1)
    try:
        ck.save(1, state(1.0)).result()
        # fill the disk but ~2 MiB: the next save writes about half its data, then ENOSPC
        st = os.statvfs(small_disk)
        filler = small_disk / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - 2 * MiB))
        exc = ck.save(2, state(2.0)).exception(timeout=120)
        assert exc is not None and "No space left on device" in str(exc), exc
        filler.unlink()  # space returns
        ck.save(3, state(3.0)).result()  # commits; retention then removes step 1
        ck.wait_idle()
    finally:
        ck.close()
    store = open_store(root)
    assert catalog.committed_steps(store) == [3]
    assert list(store.list(f"{mf.step_dir(2)}/")) == []  # the failed step was reclaimed too
    assert verify(store, 3).ok
    got = state(0.0)
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 3
    assert all(torch.equal(t, torch.full((128, 1024), 3.0 + i)) for i, t in enumerate(got["t"].values()))
