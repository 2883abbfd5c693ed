"""Issue 28 items 1-2: a dead job's claims retired by the operator (``ckptd fence``), the resume
warning that names the command, and a re-saved step holding nothing of the attempt it took over
(``ckptd verify`` warns about objects no committed attempt owns)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ckptd import catalog, claims, donetree
from ckptd import manifest as mf
from ckptd.errors import CheckpointError, StepHeld
from ckptd.verify import verify
from storage_backends import open_store
from tests.faults.slow_writer_job import state
from tests.faults.test_slow_writer import ROOT, assert_holds, skips_a_held_step, writing_writer
from trainer_hooks import Checkpointer
from trainer_hooks.hook import CheckpointHook

pytestmark = [pytest.mark.timeout(300)]


def ckptd(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def objects(root: str, step: int) -> set[str]:
    store = open_store(root)
    try:
        folder = f"{mf.step_dir(step)}/"
        return {o.key[len(folder) :] for o in store.list(folder) if not o.key.startswith(f"{folder}{mf.CLAIMS}/")}
    finally:
        store.close()


def test_fence_lets_a_resubmitted_job_save_the_dead_jobs_step(tmp_path, caplog):
    root = str(tmp_path / "root")
    with Checkpointer(root, job_id="job-a") as ck:
        ck.save(4, state(0)).result(timeout=120)
    a = writing_writer(root, "job-a", 1, 5, tmp_path / "a")
    try:
        # a live writer is never fenced off early
        r = ckptd("fence", root, "--job", "job-a")
        assert r.returncode == 1 and "refusing to fence a live writer" in r.stderr, r.stderr
    finally:
        a.send_signal(signal.SIGKILL)  # the node dies
        a.communicate()
    # the job is resubmitted under a new id: it resumes from step 4; step 5 is refused, naming
    # the command that retires the dead job's claims
    with Checkpointer(root, job_id="job-b") as ck:
        hook = CheckpointHook(ck, state(0), every_n_steps=None, save_on_signal=False)
        try:
            assert hook.resume() == 5
        finally:
            hook.close()
        with pytest.raises(StepHeld, match=f"ckptd fence {open_store(root).uri} --job job-a"):
            ck.save(5, state(2)).result(timeout=120)  # within the dead job's lease
    r = ckptd("fence", root, "--job", "job-a", "--force")  # the operator knows the node is dead
    assert r.returncode == 0 and "fenced step 5 of job 'job-a'" in r.stdout, r.stderr
    assert ckptd("fence", root, "--job", "job-a").stderr.strip().endswith("no partial step of job 'job-a' in " + root)
    with Checkpointer(root, job_id="job-b") as ck:  # at once, not a lease later
        ck.save(5, state(2)).result(timeout=120)
    assert_holds(root, 5, 2, "job-b")
    store = open_store(root)
    report = verify(store, 5)
    assert report.ok and report.warnings == [], report
    store.close()


def test_a_requeued_job_skips_the_step_a_live_lease_holds_and_saves_the_next(tmp_path, caplog):
    """Job A holds a live lease on step 5 (a real writer process, held while writing it). Job B,
    requeued under a new id, resumes from step 4 and reaches step 5: it skips 5 with one WARNING
    naming `ckptd fence`, and saves and commits step 6. A may still commit 5 (it is alive here and
    does); the newest committed step, B's 6, is what a restore takes."""
    root = str(tmp_path / "root")
    warning = skips_a_held_step(root, tmp_path / "a", caplog, lambda: Checkpointer(root, job_id="job-b"))
    assert "--job job-a" in warning
    got = state(9)
    with Checkpointer(root, job_id="job-c") as ck:
        assert ck.restore(got) == 6  # the newest committed step, whoever committed 5 later


def test_a_second_step_held_by_a_live_job_stops_the_save(tmp_path):
    """Skipping is once per job: a live job that holds a second step this job reaches is a
    second writer at work on the root, and the save fails as two writers must."""
    root = str(tmp_path / "root")
    a = writing_writer(root, "job-a", 1, 5, tmp_path / "a")
    a2 = None
    try:
        a2 = writing_writer(root, "job-a", 1, 6, tmp_path / "a2")
        with Checkpointer(root, job_id="job-b") as ck:
            ck.save(5, state(2))  # refused in the background, looked at by nobody
            ck.save(6, state(2))  # skips 5 (once); refused in the background
            with pytest.raises(CheckpointError, match="an earlier save \\(step 6\\) failed: .*ckptd fence"):
                ck.save(7, state(2))
    finally:
        for p in (a, a2):
            if p is not None:
                p.kill()
                p.communicate()


def test_a_resaved_step_keeps_nothing_of_the_attempt_it_took_over(tmp_path):
    # A 4-rank attempt of step 3 died half-way: shards of ranks 2 and 3 (which a 2-rank save never
    # writes), rank 0's metadata, a done record. The job restarts and saves step 3 again.
    root = str(tmp_path / "root")
    store = open_store(root)
    claims.begin(store, 3, "dead", "job-a")
    folder = mf.step_dir(3)
    dead = {"arrays/t/w0/c/2/0", "arrays/t/w0/c/3/0", "manifest.json", "zarr.json"}
    for key in dead:
        store.put(f"{folder}/{key}", b"the dead attempt's bytes")
    rec = {"rank": 2, "writer": "job-a", "bytes": 1, "objects": 1, "shards": []}
    done = donetree.write_done(store, 3, "dead", 2, rec)
    with Checkpointer(root, job_id="job-a") as ck:  # the same job restarted: takes over at once
        ck.save(3, state(5)).result(timeout=120)
    assert_holds(root, 3, 5, "job-a")
    left = objects(root, 3)
    assert not {"arrays/t/w0/c/2/0", "arrays/t/w0/c/3/0", done[len(folder) + 1 :]} & left, left
    assert store.get(f"{folder}/manifest.json") != b"the dead attempt's bytes"
    assert verify(store, 3).warnings == []
    # an object landing after the commit (a late write of a superseded writer) is reported
    store.put(f"{folder}/arrays/t/w0/c/7/0", b"late")
    report = verify(store, 3)
    assert report.ok and len(report.warnings) == 1 and "c/7/0" in report.warnings[0], report
    r = ckptd("verify", root, "--step", "3")
    assert r.returncode == 0 and "no committed attempt owns" in r.stderr, r.stderr
    assert catalog.committed_steps(store) == [3]
    store.close()
