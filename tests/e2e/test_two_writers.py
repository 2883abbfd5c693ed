"""Two jobs started by mistake on one job root, saving the same steps at the same time: one is
refused at each step with an error naming the other job; no committed step mixes their data;
every committed step passes ``verify`` and restores one job's values. Local FS and S3 (moto
and Ceph RGW)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd import catalog
from ckptd.verify import verify
from storage_backends import open_store
from tests import load
from trainer_hooks import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_two_jobs(root: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):  # two jobs: two identities
        env.pop(k, None)
    # Each job's output goes to a file: a pipe read only after the other job ends could fill
    # and stop a job that waits for the other at a barrier.
    procs = {}
    for name, value in (("a", "1"), ("b", "2")):
        with open(out / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.writer_job", root, name, value, str(out), str(STEPS)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        for name, p in procs.items():
            load.wait(p, 400, out / f"{name}.log")
            log = (out / f"{name}.log").read_text(errors="replace")
            assert p.returncode == 0, f"job {name}:\n{log[-4000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: json.loads((out / f"{name}.json").read_text()) for name in procs}


def check(root: str, results: dict) -> None:
    ids = {name: r.pop("job_id") for name, r in results.items()}
    store = open_store(root)
    committed = catalog.committed_steps(store)
    refusals = 0
    for step in range(1, STEPS + 1):
        a, b = results["a"][str(step)], results["b"][str(step)]
        assert a is None or b is None, f"step {step}: both saves failed: {a} / {b}"
        assert a is not None or b is not None, f"step {step}: both jobs were told their save committed"
        err, other = (a, "b") if a is not None else (b, "a")
        loser = "a" if other == "b" else "b"
        # one clear refusal, naming the job that holds the step (or saying it is committed)
        refused = err.startswith(("StepClaimed", "StepHeld")) and repr(ids[other]) in err
        assert refused or "already committed" in err, err
        refusals += 1
        assert step in committed
        winner = "a" if a is None else "b"
        rec = catalog.read_commit(store, step)
        assert rec["writer"] == ids[winner] != ids[loser]
        report = verify(store, step)
        assert report.ok, report.errors
        state = {"t": {f"w{i}": torch.zeros(64, 64) for i in range(8)}, "who": None}
        with Checkpointer(root) as ck:
            assert ck.restore(state, step=step) == step
        want = 1.0 if winner == "a" else 2.0
        assert state["who"] == winner
        for key, t in state["t"].items():  # never a mix of the two jobs' tensors
            assert torch.all(t == want), f"step {step}: {key} holds the other job's data"
    assert refusals == STEPS
    store.close()


def test_two_jobs_on_one_local_root(tmp_path):
    root = str(tmp_path / "job")
    check(root, run_two_jobs(root, tmp_path))


@pytest.mark.s3
def test_two_jobs_on_one_s3_root(s3_target, tmp_path):
    """On moto and on a real Ceph RGW: the claims and commit records are put_if_absent."""
    check(s3_target.root, run_two_jobs(s3_target.root, tmp_path))
