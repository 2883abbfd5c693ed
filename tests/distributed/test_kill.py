"""A saving job killed with SIGKILL in the middle of a save: the step stays partial, restore
takes the previous committed step, and verify passes on it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptd import catalog
from storage_backends import open_store
from tests import load
from tests.distributed import launch
from tests.distributed.scenarios import Tiny
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True)


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_mid_save_leaves_partial_and_previous_restores(tmp_path, world):
    root = str(tmp_path / "job")
    procs = launch.spawn(world, "save_then_hang", {"root": root, "delay": 0.3}, tmp_path)
    deadline = load.deadline(180)
    while not all((tmp_path / f"save_returned_{r}").exists() for r in range(world)):
        assert all(p.poll() is None for p in procs), launch.logs(tmp_path, "save_then_hang", world)
        assert time.monotonic() < deadline, "save never returned\n" + launch.logs(tmp_path, "save_then_hang", world)
        time.sleep(0.1)
    time.sleep(0.5)  # some (slowed) puts of step 2 are under way
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()

    store = open_store(root)
    infos = {i.step: i for i in catalog.list_checkpoints(store)}
    assert infos[1].committed and not infos[2].committed
    assert catalog.latest_step(store) == 1

    out = ckptd("ls", root, "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["step"]: r for r in json.loads(out.stdout)}
    assert rows[1]["committed"] is True and rows[2]["committed"] is False

    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    state = {"model": model, "optim": optim, "sched": sched, "extra": {}, "meta": {}}
    with Checkpointer(root) as ck:
        assert ck.restore(state, strict=False) == 1
        with pytest.raises(Exception, match="partial"):
            ck.restore(state, step=2, strict=False)

    v = ckptd("verify", root)
    assert v.returncode == 0, v.stderr
    v2 = ckptd("verify", root, "--step", "2")
    assert v2.returncode == 1 and "partial" in v2.stderr
