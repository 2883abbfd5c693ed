"""The staging folder's budget, lease ownership and journal, and the served-roots check, in
this process (no daemon needed)."""

from __future__ import annotations

import json
import time

import pytest

from ckptd.cli.main import main
from ckptd.server.roots import RootError, Roots
from ckptd.server.settings import parse_size
from ckptd.server.staging import BudgetFull, LeaseBusy, LeaseGone, Staging


@pytest.fixture
def staging(tmp_path):
    s = Staging(tmp_path / "stg", budget=1000, lease_ttl_s=60, stall_s=30)
    yield s
    s.close()


def _fill(lease, n):
    (lease.dir / "0.bin").write_bytes(b"x" * n)


def test_budget_refuses_then_grants_when_an_upload_frees_memory(staging):
    a = staging.create("/r", 0, need=600, want=600, ticket="a")
    _fill(a, 600)
    staging.hand_off(a.id, "job-a", {"state": "accepted"})  # uploading: memory that will be freed
    with pytest.raises(BudgetFull):
        staging.create("/r", 1, need=600, want=600, ticket="b")
    # a client waits, so the finished upload frees its lease instead of handing it back
    assert staging.uploaded(a.id, {"state": "uploaded"}) is False
    with pytest.raises(LeaseGone):
        staging.acquire(a.id)
    b = staging.create("/r", 1, need=600, want=600, ticket="b")
    assert staging.staged_bytes == 600 and b.bytes == 600


def test_lease_is_handed_back_and_reused_without_pressure(staging):
    a = staging.create("/r", 0, need=100, want=100, ticket="a")
    _fill(a, 100)
    staging.hand_off(a.id, "job", {"state": "accepted"})
    with pytest.raises(LeaseBusy):  # the client must not write while the daemon reads
        staging.acquire(a.id)
    with pytest.raises(LeaseBusy):
        staging.hand_off(a.id, "job2", {})
    assert staging.uploaded(a.id, {"state": "uploaded"}) is True
    assert staging.acquire(a.id).owner == "client"
    assert json.loads((a.dir / "job.json").read_text())["state"] == "uploaded"


def test_idle_leases_are_freed_for_a_waiting_client(staging):
    a = staging.create("/r", 0, need=800, want=800, ticket="a")
    _fill(a, 800)
    staging.hand_off(a.id, "job", {})
    staging.uploaded(a.id, {})
    a_idle = staging.get(a.id)
    assert a_idle.owner == "client" and not a_idle.active
    b = staging.create("/r", 1, need=500, want=500, ticket="b")  # frees the idle lease at once
    assert b.bytes == 500
    with pytest.raises(LeaseGone):
        staging.acquire(a.id)


def test_over_budget_when_nothing_else_can_free_memory(staging):
    # a single snapshot larger than the budget must not wait forever
    big = staging.create("/r", 0, need=5000, want=5000, ticket="a")
    assert big.bytes == 5000
    # two clients each holding part of their first snapshot, both waiting: no deadlock
    staging.release(big.id)
    a = staging.create("/r", 0, need=600, want=600, ticket="a")
    b = staging.create("/r", 1, need=300, want=300, ticket="b")
    with pytest.raises(BudgetFull):
        staging.grow(a.id, need=400, want=400)  # b is still copying: it may hand off and free
    # b needs more too, while a waits for b: neither can progress, so b is granted over budget
    assert staging.grow(b.id, need=400, want=400).bytes == 700


def test_wait_is_granted_after_a_stall(tmp_path):
    s = Staging(tmp_path / "stg", budget=100, lease_ttl_s=60, stall_s=0.05)
    try:
        a = s.create("/r", 0, need=100, want=100, ticket="a")
        _fill(a, 100)
        s.hand_off(a.id, "j", {})  # an upload that never finishes (a stuck peer)
        with pytest.raises(BudgetFull):
            s.create("/r", 1, need=100, want=100, ticket="b")
        time.sleep(0.1)
        assert s.create("/r", 1, need=100, want=100, ticket="b").bytes == 100
    finally:
        s.close()


def test_recover_adopts_journalled_jobs_and_removes_junk(tmp_path):
    s = Staging(tmp_path / "stg", budget=1000)
    a = s.create("/r", 0, need=10, want=10, ticket="a")
    s.hand_off(a.id, "job-a", {"job": "job-a", "state": "accepted"})
    idle = s.create("/r", 1, need=10, want=10, ticket="b")
    (tmp_path / "stg" / "leases" / "junk").mkdir()
    s.close()
    s2 = Staging(tmp_path / "stg", budget=1000)
    try:
        found = {lease.id: job for lease, job in s2.recover()}
        assert found == {a.id: {"job": "job-a", "state": "accepted"}, idle.id: None}
        assert s2.get(a.id).owner == "daemon" and s2.get(idle.id).owner == "client"
        assert not (tmp_path / "stg" / "leases" / "junk").exists()
    finally:
        s2.close()


def test_one_daemon_per_staging_folder(staging):
    with pytest.raises(RuntimeError, match="already uses the staging folder"):
        Staging(staging.folder, budget=10)


def test_roots():
    roots = Roots(["/srv/ckpt", "s3://bucket/jobs", "file:///data/x"])
    for ok in ("/srv/ckpt", "/srv/ckpt/run-1", "file:///srv/ckpt/a", "s3://bucket/jobs/a/b", "/data/x/y"):
        assert roots.check(ok) == ok
    for bad in ("/srv/ckpt-2", "/srv/ckpt/../etc", "/srv", "s3://bucket", "s3://bucket/jobsx", "s3://other/jobs", "x"):
        with pytest.raises(RootError):
            roots.check(bad)
    with pytest.raises(RootError):
        Roots([])


def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2 GB") == 2 * 10**9
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")


def test_serve_usage_errors(capsys, monkeypatch):
    monkeypatch.delenv("CKPTD_ROOTS", raising=False)
    assert main(["serve"]) == 2
    assert "needs at least one --root" in capsys.readouterr().err
    assert main(["serve", "--root", "/x", "--budget", "lots"]) == 2
    assert "invalid size" in capsys.readouterr().err
