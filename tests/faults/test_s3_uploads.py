"""Incomplete S3 multipart uploads: gc and the daemon's housekeeping abort the stale ones under
the root (never outside it); a lost CreateMultipartUpload response leaves no orphan; a failed
save aborts its own (issue 14, item 6). Against moto and a real Ceph RGW (``s3_target``),
faults through the proxy."""

from __future__ import annotations

import json
import os

import pytest

from ckptd.errors import CheckpointError
from storage_backends.s3 import S3Store
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.faults.common import cli
from tests.faults.workers import campaign_state
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]

MiB = 1 << 20


def _orphans(client, bucket: str) -> dict[str, str]:
    """Start three uploads as a killed writer would leave them (one part each): under the job
    root, in a sibling prefix that merely starts like it, and elsewhere in the bucket."""
    out = {}
    for key in ("job/step_0000000001/arrays/w/c/0", "job2/x", "other/y"):
        up = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * 1024)
        out[key] = up
    return out


def _uploads(client, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_gc_aborts_stale_uploads_under_the_root_only(s3_target):
    bucket = s3_target.bucket
    client = s3_target.client()
    _orphans(client, bucket)
    out = cli("gc", s3_target.root, "--keep-last", "1", "--abort-uploads-older-than", "0", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["aborted_uploads"] == ["step_0000000001/arrays/w/c/0"]
    assert _uploads(client, bucket) == ["job2/x", "other/y"]
    out = cli("gc", s3_target.root, "--keep-last", "1", "--abort-uploads-older-than", "soon")
    assert out.returncode == 2 and "invalid duration" in out.stderr


def test_daemon_housekeeping_aborts_stale_uploads(s3_target, tmp_path):
    bucket = s3_target.bucket
    client = s3_target.client()
    _orphans(client, bucket)
    env = {"CKPTD_HOUSEKEEPING_INTERVAL_S": "0.2", "CKPTD_ABORT_UPLOADS_OLDER_THAN_S": "0"}
    with Daemon([s3_target.root], tmp_path / "staging", tmp_path / "daemon.log", **env) as d:
        wait_for(lambda: _uploads(client, bucket) == ["job2/x", "other/y"], "the sweep", 120, logs=d.logs)
        assert d.metric("ckptd_uploads_aborted_total") == 1


def test_a_lost_create_multipart_response_leaves_no_orphan(s3_target):
    bucket = s3_target.bucket
    client = s3_target.client()
    data = os.urandom(12 * MiB + 7)
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "CreateMultipartUpload", "lost")])
    with FaultProxy(s3_target.url, plan) as proxy:
        store = S3Store(bucket, "job", endpoint_url=proxy.url, part_size=5 * MiB, multipart_threshold=5 * MiB)
        try:
            store.put("big", data)
        finally:
            store.close()
        # the first upload really was created upstream, and its answer really was lost
        assert proxy.counters["fault:lost:CreateMultipartUpload"] == 1
        assert proxy.counters["op:CreateMultipartUpload"] == 2
    assert client.get_object(Bucket=bucket, Key="job/big")["Body"].read() == data
    assert _uploads(client, bucket) == []


def test_a_failed_save_aborts_its_own_uploads(s3_target, monkeypatch):
    """Permission to upload parts is lost in the middle of a save: the save fails with one
    error and leaves no incomplete upload behind."""
    bucket = s3_target.bucket
    client = s3_target.client()
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "UploadPart", "403", times=10**6)])
    with FaultProxy(s3_target.url, plan) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("CKPTD_S3_PART_SIZE", "5M")
        monkeypatch.setenv("CKPTD_S3_MULTIPART_THRESHOLD", "5M")
        with Checkpointer(s3_target.root) as ck:
            fut = ck.save(1, campaign_state(1, big=True))
            with pytest.raises(CheckpointError, match="AccessDenied"):
                fut.result(timeout=240)
        assert proxy.counters["op:CreateMultipartUpload"] >= 1
    assert _uploads(client, bucket) == []
