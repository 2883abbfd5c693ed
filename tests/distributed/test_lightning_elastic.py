"""Lightning jobs that stop mid-epoch at 2 processes and resume at 2 and at 3, for real: each job
is started as a user starts one and Lightning's own DDP launcher starts its other ranks (gloo on
the CPU). The model records the sample indices of every training step; across the first job (up
to its last committed step) and a resumed one, every sample of epoch 0 is trained on exactly once,
and the resumed job's next epoch is whole, at either world size.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd import catalog
from storage_backends import open_store
from tests import load

pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed (pip install -e .[lightning])")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("lightning_worker.py")
N = 96  # as in lightning_worker.py: batches of 4, a save every 2 steps


def committed(root: Path) -> list[int]:
    with open_store(str(root)) as store:
        return catalog.committed_steps(store)


def job(out: Path, root: Path, devices: int, **args) -> list[dict]:
    """Run one job to its end; its ranks' records, and check each rank's result."""
    out.mkdir()
    argv = [sys.executable, str(WORKER), json.dumps({"root": str(root), "out": str(out), "devices": devices, **args})]
    log = out / "job.log"
    with open(log, "w") as f:  # an idle machine takes ~15 s; a loaded one 60 s and more
        rc = subprocess.run(
            argv, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=load.scaled(600)
        ).returncode
    assert rc == 0, log.read_text()[-6000:]
    lines = [line for r in range(devices) for line in (out / f"records.rank{r}.jsonl").read_text().splitlines()]
    return [json.loads(line) for line in lines]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def once(indices: list[int]) -> tuple[list[int], list[int]]:
    """(indices trained on more than once, indices of the epoch never trained on)."""
    counts = collections.Counter(indices)
    return sorted(i for i, n in counts.items() if n > 1), sorted(set(range(N)) - set(counts))


def test_two_processes_then_two_or_three_train_each_sample_once(tmp_path: Path) -> None:
    root = tmp_path / "job"
    first = job(tmp_path / "first", root, 2, max_epochs=2, stop_at=4)
    assert committed(root) == [2, 4]  # 2 ranks x 4 steps x 4 samples: 32 of the 96
    assert sorted(r["step"] for r in first) == [1, 1, 2, 2, 3, 3, 4, 4]
    shutil.copytree(root, tmp_path / "job3")

    # the rest of epoch 0 (64 samples), then epoch 1: 2 ranks take 8 + 12 steps, 3 ranks 6 + 8
    # (Lightning's batch counter, 4, plus the 6 left would pass the 8 of an epoch at 3); at 3, a
    # worker process per rank, which prefetches batches ahead of training
    for devices, where, final, workers in ((2, root, 24, 0), (3, tmp_path / "job3", 18, 1)):
        resumed = job(tmp_path / f"resumed{devices}", where, devices, max_epochs=2, num_workers=workers)
        results = [json.loads((tmp_path / f"resumed{devices}" / f"result{r}.json").read_text()) for r in range(devices)]
        assert results == [{"restored": 4, "global_step": final, "epoch": 2}] * devices
        assert sorted({r["step"] for r in resumed}) == list(range(5, final + 1))
        epoch0 = [i for r in first + resumed if r["epoch"] == 0 for i in r["idx"]]
        assert once(epoch0) == ([], []), f"at {devices}: (trained twice, never trained) in epoch 0"
        epoch1 = [i for r in resumed if r["epoch"] == 1 for i in r["idx"]]
        assert once(epoch1) == ([], []), f"at {devices}: (trained twice, never trained) in epoch 1"
        assert committed(where)[-1] == final
