"""The bounded fault campaign of CI (issue 14): SIGKILLs of trainers, ``gc`` and the daemon at
random points of save, commit, retention and gc (at least 30 per run), S3 faults on 10% and 50%
of requests, a disk that fills up at random points of a save, two jobs saving on one root;
every invariant of ``tests.faults.campaign`` checked after every event. Seeded: the schedule of faults and kill
times is the same on every run (what the processes do meanwhile is not).

The long campaign is ``python -m benchmarks.faults``."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import boto3
import pytest

from tests.doubles.faults import KINDS, FaultPlan, FaultProxy, tmpfs_mount
from tests.faults.campaign import Campaign, Root
from tests.s3server import CREDENTIALS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEED = 14


def test_campaign_trainer_and_gc_kills_on_a_local_root(tmp_path):
    camp = Campaign(tmp_path / "work", seed=SEED)
    root = Root(str(tmp_path / "job"), {})
    for i in range(26):
        camp.trainer_kill(root, keep_last=2, window=(0.05, 1.2))
        if i % 8 == 7:
            camp.gc_kill(root, {})
    camp.run_trainer(root, 2)  # the job goes on after it all
    newest = camp.check(root)
    assert newest is not None and newest >= 1
    _assert_nothing_but(Path(root.uri), newest)
    gc_runs = camp.counts["kills: gc"] + camp.counts["gc finished before its kill"]
    # 26 + 3 (S3) + 2 (daemon) = 31 kills per run at least, plus the gc runs killed in time
    assert camp.counts["kills: trainer"] == 26 and gc_runs == 3


@pytest.fixture
def s3_root(s3_server):
    """A job root in a fresh bucket, reached through a fault proxy (no faults yet)."""
    bucket = f"ckptd-faults-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    with FaultProxy(s3_server) as proxy:
        env = {
            **CREDENTIALS,  # the forkserver may have started before the s3_server fixture set them
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL": proxy.url,
            "CAMPAIGN_DIRECT_ENDPOINT": s3_server,
            "CKPTD_S3_PART_SIZE": "5M",
            "CKPTD_S3_MULTIPART_THRESHOLD": "5M",
        }
        yield Root(f"s3://{bucket}/job", env, big=True), proxy


@pytest.mark.s3
def test_campaign_s3_faults_and_kills(tmp_path, s3_root):
    root, proxy = s3_root
    camp = Campaign(tmp_path / "work", seed=SEED)
    kinds = (*KINDS, "stall")
    proxy.set_plan(FaultPlan(rate=0.10, kinds=kinds, seed=SEED, delay_s=0.1, stall_s=1.0))
    for _ in range(3):
        camp.trainer_kill(root, keep_last=2, window=(0.3, 2.0))
    camp.run_trainer(root, 1)
    camp.check(root)
    at_10 = proxy.faults()
    proxy.set_plan(FaultPlan(rate=0.50, kinds=kinds, seed=SEED + 1, delay_s=0.1, stall_s=1.0))
    camp.run_trainer(root, 1, keep_last=2)
    camp.check(root)
    assert at_10 > 0 and proxy.faults() > at_10, dict(proxy.counters)
    assert camp.counts["kills: trainer"] == 3
    # every save either committed or failed with one clear error (the campaign checks each); the
    # runs to completion, at 10% and at 50%, committed (botocore's and ckptd's retries absorb it)
    assert camp.counts["saves committed"] >= 2


def test_campaign_daemon_kills(tmp_path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm for the daemon's staging")
    camp = Campaign(tmp_path / "work", seed=SEED)
    root = Root(str(tmp_path / "job"), {})
    staging = Path("/dev/shm") / f"ckptd-campaign-{uuid.uuid4().hex[:12]}"
    try:
        for _ in range(2):
            camp.daemon_kill(root, staging, tmp_path / "daemon.log")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert camp.counts["kills: daemon"] == 2


def test_campaign_disk_full_at_random_points(tmp_path):
    mnt = tmp_path / "small"
    try:
        ctx = tmpfs_mount(str(mnt), "1m")
        ctx.__enter__()
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs for the disk-full faults: {e}")
    try:
        camp = Campaign(tmp_path / "work", seed=SEED)
        root = Root(str(mnt / "job"), {})
        camp.run_trainer(root, 1, keep_last=1)
        full = failed = 0
        for _ in range(8):
            free = shutil.disk_usage(mnt).free
            ballast = mnt / "ballast"
            with open(ballast, "wb") as f:  # leave a random few KiB: the save runs out midway
                f.write(b"\0" * max(0, free - camp.rng.randrange(0, 48 << 10)))
            lines = camp.run_trainer(root, 1, keep_last=1)
            full += 1
            failed += sum(x.startswith("fail") for x in lines)
            assert all("No space left" in x or "ENOSPC" in x or "Errno 28" in x for x in lines if x.startswith("fail"))
            camp.check(root)
            ballast.unlink()
            camp.run_trainer(root, 1, keep_last=1)  # space is back
            camp.check(root)
        assert failed >= 1, "the disk never filled up mid-save: the test proves nothing"
        camp.counts["disk-full events"] += full
    finally:
        ctx.__exit__(None, None, None)


def test_campaign_two_writers_on_one_root_are_refused_never_mixed(tmp_path):
    """Two jobs started by mistake on one root save the same steps at the same time, three
    times over: a second writer must be refused with an error of its own (not just "already
    committed"), and every committed step must be one job's, whole (checked after each round).
    Without fencing both write, and steps mix."""
    camp = Campaign(tmp_path / "work", seed=SEED)
    uri = str(tmp_path / "job")
    fails: list[str] = []
    for first in (1, 5, 9):
        jobs = [camp.trainer(Root(uri, {}, next_step=first), 4) for _ in range(2)]
        for p, _ in jobs:
            p.join(300)
            assert p.exitcode == 0
        for _, prog in jobs:
            fails += [x for x in prog.read_text().splitlines() if x.startswith("fail")]
        camp.check(Root(uri, {}), gc=False)
    refused = [x for x in fails if "already committed" not in x]
    assert refused, f"the second writer was never refused: {fails}"


def test_campaign_slow_writers_and_same_id_restarts(tmp_path):
    """A writer SIGSTOPped mid-save, its step taken over after its lease by another job, then by
    the same job id restarted; it resumes and its late writes land: every invariant holds."""
    camp = Campaign(tmp_path / "work", seed=SEED)
    root = Root(str(tmp_path / "job"), {})
    camp.run_trainer(root, 1)
    camp.slow_writer(root, same_id=False)
    camp.slow_writer(root, same_id=True)
    assert camp.counts["slow writers stopped, taken over, resumed"] == 1
    assert camp.counts["slow writers stopped, taken over, resumed (same job id)"] == 1


@pytest.mark.s3
def test_campaign_partitioned_writer(tmp_path, s3_root):
    root, _ = s3_root
    camp = Campaign(tmp_path / "work", seed=SEED)
    camp.run_trainer(root, 1)
    camp.partition(root)
    assert camp.counts["partitions: writer cut off, taken over, its PUTs landed late"] == 1


def _assert_nothing_but(root: Path, newest: int) -> None:
    """After a clean save and gc: only the kept steps, not one temp file anywhere."""
    names = sorted(os.listdir(root))
    assert all(n.startswith(("step_", "_")) for n in names), names  # steps and the root's records
    temps = [str(p) for p in root.rglob("*") if ".tmp." in p.name]
    assert temps == []
