"""``deploy/slurm/elastic.sbatch`` under a real slurmctld and slurmd (one node, on loopback).

One job, one unchanged batch script, three sizes: submitted at 4 tasks, preempted by a job of a
higher-priority partition (``PreemptMode=REQUEUE``: Slurm sends SIGTERM to the job's steps), the
script requeues itself, the pending job is resized to 3 tasks (``scontrol update NumTasks``) and
runs again; then its time limit comes near (``--signal=B:USR1@120`` of the recipe: USR1 to the
batch shell, which forwards SIGTERM to the steps and requeues), it is resized to 2 tasks and runs
to the end of the epoch. The training script (``tests/systems/exact_train.py``) makes the final
state independent of the world size bit for bit, so the job's final model and AdamW state must
equal those of an uninterrupted single-process run exactly, and every sample of the epoch must
have been trained on exactly once.

The recipe as shipped, with its own training script (``examples/train_elastic.py``) on an S3 root:
a listing of the root that fails is retried, and one that keeps failing fails the job with the
reason instead of starting the ranks as if the root were empty.

Needs ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them); skipped when they are absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from ckptd import catalog
from storage_backends import open_store
from tests import load
from tests.distributed import launch
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.systems.slurm import SlurmCluster, missing_binaries
from trainer_hooks import Checkpointer

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "elastic.sbatch"
SAMPLES, GLOBAL_BATCH = 480, 12  # 40 steps; 12 splits over 4, 3 and 2 ranks
STOP_AT_4, STOP_AT_3 = 9, 24  # steps where the test stops the job

pytestmark = [
    pytest.mark.slow,
    # Above the sum of the longest test's own bounds (~1,900 s), so that one of those fires first
    # with the job's output; idle the file takes a few minutes. Both times load.SCALE.
    pytest.mark.timeout(2400),
    pytest.mark.skipif(bool(missing_binaries()), reason=f"Slurm/munge not installed: {missing_binaries()}"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=8)
    try:
        yield c.start()
    finally:
        c.stop()


def _steps(log_dir: Path) -> list[dict]:
    out = []
    for f in sorted(log_dir.glob("rank*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _wait_all_ranks_at(log_dir: Path, step: int, world: int, cluster: SlurmCluster, job: int, timeout=300.0):
    deadline = load.deadline(timeout)
    while True:
        done = {r["rank"] for r in _steps(log_dir) if (r["event"], r["step"], r["world"]) == ("step", step, world)}
        if len(done) == world:
            return
        info = cluster.job(job)
        if info["JobState"] not in ("RUNNING", "PENDING", "CONFIGURING"):
            raise AssertionError(f"job ended ({info['JobState']}) before step {step}:\n{_out(job)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks at world {world} did not reach step {step}:\n{_out(job)}")
        time.sleep(0.5)


_OUT_DIR: list[Path] = []


def _out(job: int, tail: int = 6000) -> str:
    f = _OUT_DIR[0] / f"slurm-{job}.out"
    return f.read_text(errors="replace")[-tail:] if f.exists() else "(no output)"


def _wait_requeued(cluster: SlurmCluster, job: int, restarts: int) -> float:
    """Pending again and the previous run gone from the node (``SlurmCluster.wait_requeued``);
    the job's output in the failure message."""
    try:
        return cluster.wait_requeued(job, restarts)
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError(f"{e}\n{_out(job)}") from None


def test_sbatch_recipe_preempted_and_time_limited_resumes_at_4_3_2_tasks_exactly(cluster, tmp_path):
    _OUT_DIR[:] = [tmp_path]
    recipe_digest = hashlib.sha256(SBATCH.read_bytes()).hexdigest()
    env_common = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    # The reference: one process, never stopped.
    ref = load.run(
        [sys.executable, "tests/systems/exact_train.py", "--root", str(tmp_path / "ref"), "--samples", str(SAMPLES)]
        + ["--global-batch", str(GLOBAL_BATCH), "--final", str(tmp_path / "ref.pt")],
        300,
        cwd=REPO,
        env={**os.environ, **env_common},
    )
    assert ref.returncode == 0, ref.stderr

    logs, hold = tmp_path / "logs", tmp_path / "hold"
    hold.write_text(str(STOP_AT_4))
    job_env = {
        **env_common,
        "CKPT_ROOT": str(tmp_path / "root"),
        "TRAIN": "tests/systems/exact_train.py",
        "GLOBAL_BATCH": str(GLOBAL_BATCH),
        "RDZV_PORT": str(launch.free_port()),
        "EXACT_SAMPLES": str(SAMPLES),
        "EXACT_LOG_DIR": str(logs),
        "EXACT_FINAL": str(tmp_path / "final.pt"),
        "EXACT_HOLD_FILE": str(hold),
    }
    # The recipe's #SBATCH lines ask for 2-4 nodes of 8 tasks; this cluster has one node. The
    # command line overrides only the size and where the output goes.
    job = cluster.sbatch(
        ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=30", f"--chdir={REPO}"]
        + [f"--output={tmp_path}/slurm-%j.out", str(SBATCH)],
        **job_env,
    )

    # 1. At 4 tasks: preemption. A job in the higher-priority partition needs all 8 CPUs.
    # The ranks stay held at STOP_AT_4 until the signal comes (the scheduler may take a while).
    _wait_all_ranks_at(logs, STOP_AT_4, 4, cluster, job)
    high = cluster.sbatch(["--partition=high", "--ntasks=8", "--output=/dev/null", "--wrap", "sleep 1"])
    left_at = _wait_requeued(cluster, job, restarts=1)  # (the node idle: `high` has run too)
    hold.write_text(str(STOP_AT_3))
    cluster.wait_state(high, {"COMPLETED"}, timeout=240)

    # 2. Requeued; resized to 3 tasks while pending, and started without waiting out Slurm's
    # requeue hold, safely (SlurmCluster.start_requeued). Then the time limit comes near: 1 minute
    # left, less than the recipe's --signal=B:USR1@120, so slurmctld sends USR1 to the shell.
    cluster.start_requeued(job, left_at, *_size(3))
    _wait_all_ranks_at(logs, STOP_AT_3, 3, cluster, job)
    # (the ranks stay held at STOP_AT_3 until the signal comes)
    run_s = _runtime_s(cluster.job(job)["RunTime"])
    cluster.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={run_s // 60 + 2}"])
    left_at = _wait_requeued(cluster, job, restarts=2)

    # 3. Resized to 2 tasks, the time limit restored: runs to the end of the epoch.
    hold.unlink()
    cluster.start_requeued(job, left_at, *_size(2), "TimeLimit=30")
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    output = _out(job, tail=10**7)
    assert info["JobState"] == "COMPLETED", output[-6000:]

    # The cycle happened as Slurm drove it, with the same batch script throughout.
    assert hashlib.sha256(SBATCH.read_bytes()).hexdigest() == recipe_digest
    assert "time limit near" in output, output
    assert output.count("requeueing job") == 2, output
    for world in (4, 3, 2):
        assert f"1 nodes x {world} = {world} ranks" in output, output

    records = _steps(logs)
    steps = [r for r in records if r["event"] == "step"]
    per_step = {}
    for r in steps:
        per_step.setdefault(r["step"], []).append(r)
    # No step was trained twice (each stop saved the step it stopped at), at the expected sizes.
    for s, rs in per_step.items():
        worlds = {r["world"] for r in rs}
        assert len(worlds) == 1 and len(rs) == next(iter(worlds)), (s, rs)
    world_of = {s: rs[0]["world"] for s, rs in per_step.items()}
    assert sorted(world_of) == list(range(SAMPLES // GLOBAL_BATCH))
    assert {world_of[s] for s in range(STOP_AT_4 + 1)} == {4}
    assert {world_of[s] for s in range(STOP_AT_4 + 1, STOP_AT_3 + 1)} == {3}
    assert {world_of[s] for s in range(STOP_AT_3 + 1, SAMPLES // GLOBAL_BATCH)} == {2}
    stops = [r for r in records if r["event"] == "stop"]
    assert {(r["world"], r["step"]) for r in stops} == {(4, STOP_AT_4), (3, STOP_AT_3)}
    # Every sample of the epoch exactly once.
    seen = Counter(i for r in steps for i in r["indices"])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}

    # The final state, bit for bit.
    final, reference = torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "ref.pt")
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), k


def _size(tasks: int) -> list[str]:
    """A pending job's new size on its one node (the recipe reads SLURM_TASKS_PER_NODE)."""
    return [f"TasksPerNode={tasks}", f"NumTasks={tasks}", f"NumCPUs={tasks}"]


def _runtime_s(text: str) -> int:
    """``scontrol``'s RunTime: [days-]hh:mm:ss."""
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def test_requeued_job_restarted_early_is_never_refused(cluster, tmp_path):
    """Requeue, restart before Slurm's requeue hold ends, five times in a row: every restart runs.

    Each requeue is made at the worst moment: at the start of a whole second, the restart asked
    for as soon as the old run has left the node, so a launch can still fall in the second of the
    kill. There ``StartTime=now`` fails (seen here on the first try): slurmd refuses the launch
    ("Job N already killed, do not launch batch job") and the job ends FAILED.
    ``start_requeued`` starts it once the clock has left the second in which the old run left the
    node."""
    restarts = 5
    out = tmp_path / "out"
    script = 'echo "run ${SLURM_RESTART_COUNT:-0}"; sleep 300'
    job = cluster.sbatch(["--requeue", "--open-mode=append", f"--output={out}", "--wrap", script])
    try:
        for n in range(restarts + 1):
            _wait_running(cluster, job, restarts=n)
            if n == restarts:
                break
            # To provoke the race, not to wait for anything: the kill early in a whole second,
            # and 2 s after the launch, so that slurmctld's scheduler (at most one pass per
            # sched_min_interval = 2 s) runs at once when the job is made eligible.
            launched = time.time()
            while time.time() < launched + 2 or time.time() % 1 > 0.05:
                time.sleep(0.005)
            cluster.run(["scontrol", "requeue", str(job)])
            left_at = cluster.wait_requeued(job, n + 1, timeout=120, poll=0.02)
            assert cluster.job(job)["Reason"] == "BeginTime"  # held by Slurm until started here
            cluster.start_requeued(job, left_at)
    finally:
        cluster.run(["scancel", str(job)], check=False)
    assert "already killed" not in (cluster.dir / "log" / "slurmd.log").read_text()
    deadline = load.deadline(60)  # the last run's line, once its output is written
    while f"run {restarts}" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [line for line in out.read_text().splitlines() if line.startswith("run ")] == [
        f"run {n}" for n in range(restarts + 1)
    ]


def _wait_running(cluster: SlurmCluster, job: int, restarts: int, timeout: float = 120.0) -> None:
    deadline = load.deadline(timeout)
    while True:
        info = cluster.job(job)
        if info["JobState"] == "RUNNING" and int(info["Restarts"]) == restarts:
            return
        assert info["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), (info, cluster.logs())
        assert time.monotonic() < deadline, (info, cluster.logs())
        time.sleep(0.2)


def test_plain_scancel_saves_and_the_job_stays_cancelled(cluster, tmp_path):
    """``scancel JOBID`` signals the batch shell too: the ranks save the step they are at, and
    the recipe must not requeue (Slurm accepts a requeue of a job being cancelled)."""
    _OUT_DIR[:] = [tmp_path]
    logs, hold = tmp_path / "logs", tmp_path / "hold"
    hold.write_text("2")
    job = cluster.sbatch(
        ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=30", f"--chdir={REPO}"]
        + [f"--output={tmp_path}/slurm-%j.out", str(SBATCH)],
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        CKPT_ROOT=str(tmp_path / "root"),
        TRAIN="tests/systems/exact_train.py",
        GLOBAL_BATCH=str(GLOBAL_BATCH),
        RDZV_PORT=str(launch.free_port()),
        EXACT_SAMPLES=str(SAMPLES),
        EXACT_LOG_DIR=str(logs),
        EXACT_HOLD_FILE=str(hold),
    )
    _wait_all_ranks_at(logs, 2, 2, cluster, job)
    cluster.run(["scancel", str(job)])
    info = cluster.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED", "PENDING"}, timeout=120)
    # wait for the batch script to have finished deciding (its last line), then look again
    deadline = load.deadline(120)
    while "cancelled: not requeueing" not in _out(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    info = cluster.job(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, _out(job))
    assert "cancelled: not requeueing (latest committed step 2)" in _out(job)


# -- the root cannot be listed ------------------------------------------------------------------
# The job's storage goes through a fault proxy in front of the moto server that answers 500 to
# every listing while the test says so. The S3 store's own retries are cut down
# (CKPTD_S3_MAX_ATTEMPTS/RETRIES) so that each failed `ckptd ls` takes seconds, not minutes; the
# recipe's retries are what is tested.
FAST_FAILING_S3 = {"CKPTD_S3_MAX_ATTEMPTS": "2", "CKPTD_S3_RETRIES": "0"}
FAIL_LISTINGS = FaultPlan(rules=[Rule(lambda r: r.op == "ListObjectsV2", "500", times=10**9)])


def _submit_shipped(cluster: SlurmCluster, tmp_path: Path, tasks: int, root: str, endpoint: str, **env: str) -> int:
    """The recipe as shipped, with its own training script (examples/train_elastic.py) and its
    defaults; only the size (one node here), the output file and the root are set."""
    return cluster.sbatch(
        ["--nodes=1", f"--ntasks-per-node={tasks}", "--cpus-per-task=1", "--time=30", f"--chdir={REPO}"]
        + [f"--output={tmp_path}/slurm-%j.out", str(SBATCH)],
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        CKPT_ROOT=root,
        AWS_ENDPOINT_URL=endpoint,
        RDZV_PORT=str(launch.free_port()),
        **FAST_FAILING_S3,
        **env,
    )


def _wait_output(job: int, text: str, cluster: SlurmCluster, timeout: float = 300.0) -> None:
    deadline = load.deadline(timeout)
    while text not in _out(job, tail=10**7):
        info = cluster.job(job)
        if info["JobState"] not in ("RUNNING", "PENDING", "CONFIGURING"):
            raise AssertionError(f"job ended ({info['JobState']}) before printing {text!r}:\n{_out(job)}")
        assert time.monotonic() < deadline, f"no {text!r} in the job's output:\n{_out(job)}"
        time.sleep(0.2)


@pytest.mark.s3
def test_a_root_that_cannot_be_listed_fails_the_job_with_the_reason(cluster, s3_server, s3_bucket, tmp_path):
    """Every listing of the root fails: the recipe retries LIST_TRIES times, then the job fails
    saying why, and no rank starts -- the committed step is not trained over from step 0."""
    _OUT_DIR[:] = [tmp_path]
    with Checkpointer(s3_bucket, job_id="earlier") as ck:
        ck.save(7, {"w": torch.arange(8.0)}).result(timeout=120)
    with FaultProxy(s3_server, FAIL_LISTINGS) as proxy:
        job = _submit_shipped(cluster, tmp_path, 2, s3_bucket, proxy.url, LIST_TRIES="3")
        info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
        output = _out(job, tail=10**7)
        assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, output)
        assert proxy.counters["fault:500:ListObjectsV2"] >= 3
    for n in (1, 2):
        assert f"listing {s3_bucket} failed (try {n}/3): retrying in {5 * 2 ** (n - 1)} s" in output, output
    assert f"cannot list {s3_bucket} (tried 3 times)" in output, output
    assert f"not starting the ranks: {s3_bucket} could not be listed" in output, output
    assert "starting at step" not in output and "torchrun" not in output, output
    store = open_store(s3_bucket)
    try:
        assert catalog.committed_steps(store) == [7]
        assert [i.step for i in catalog.list_checkpoints(store)] == [7]  # nothing else written
    finally:
        store.close()


@pytest.mark.s3
def test_the_shipped_recipe_retries_a_failed_listing_and_resumes(cluster, s3_server, s3_bucket, tmp_path):
    """The recipe and examples/train_elastic.py as shipped, on S3: a first job trains its epoch
    at 2 tasks and commits its last step; a second job at 3 tasks finds every listing failing,
    retries, and once storage answers again reshards to 3 and resumes after that step instead
    of starting over."""
    _OUT_DIR[:] = [tmp_path]
    with FaultProxy(s3_server) as proxy:
        first = _submit_shipped(cluster, tmp_path, 2, s3_bucket, proxy.url)
        info = cluster.wait_state(first, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=600)
        out1 = _out(first, tail=10**7)
        assert info["JobState"] == "COMPLETED", out1
        assert "[rank 0/2] starting at step 0" in out1, out1
        last = int(re.search(r"training ended \(latest committed step (\d+)\)", out1).group(1))
        assert last >= 0, out1

        proxy.set_plan(FAIL_LISTINGS)
        second = _submit_shipped(cluster, tmp_path, 3, s3_bucket, proxy.url)
        _wait_output(second, f"listing {s3_bucket} failed (try 1/5)", cluster)
        proxy.set_plan(FaultPlan())  # storage answers again
        info = cluster.wait_state(second, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=600)
    out2 = _out(second, tail=10**7)
    assert info["JobState"] == "COMPLETED", out2
    assert "1 nodes x 3 = 3 ranks" in out2, out2
    assert f"[rank 0/3] starting at step {last + 1}" in out2, out2
    assert "starting at step 0" not in out2, out2
    assert f"training ended (latest committed step {last})" in out2, out2
