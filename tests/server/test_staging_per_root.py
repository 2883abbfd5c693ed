"""Daemons of different roots on one machine never share a journal (issue 28, item 4): the
default staging folder is keyed by the served roots, and a daemon that finds another root's
entry in its staging folder anyway (an explicit ``--staging-dir`` shared by mistake) leaves it
alone: it neither uploads, shows nor frees it, so that root's own daemon still resumes it.

Real daemons one after the other with the same default staging base (``XDG_CACHE_HOME``; a
budget larger than /dev/shm sends the default there), a real trainer killed after its hand-off."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd import catalog
from storage_backends import open_store
from tests.server import daemon as dm
from tests.server.daemon import Daemon, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _jobs(d: Daemon) -> list[dict]:
    status, body = d.get("/v1/jobs")
    assert status == 200, body
    return body if isinstance(body, list) else body["jobs"]


def _lease_folders(staging: str) -> list[str]:
    return sorted(p.name for p in (Path(staging) / "leases").iterdir())


def test_daemons_of_other_roots_never_adopt_a_journal(tmp_path):
    root_b, root_a = str(tmp_path / "b" / "job"), str(tmp_path / "a" / "job")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "CKPTD_BUDGET": str(1 << 60)}
    # B's daemon takes the hand-off but uploads slowly; trainer and daemon die before the commit
    d1 = Daemon([root_b], None, tmp_path / "d1.log", upload_delay_s=60, **env).start()
    try:
        dm.kill_all(dm.saves_returned([d1], root_b, tmp_path))
    finally:
        d1.kill()
    staging_b = d1.logs().split("staging in ", 1)[1].split(" (", 1)[0]
    assert str(tmp_path / "cache") in staging_b, d1.logs()
    leases_b = _lease_folders(staging_b)
    assert leases_b, "no journalled entry left behind: the test proves nothing"
    store = open_store(root_b)
    assert catalog.read_commit(store, 1) is None

    # A's daemon on the same default base: a staging folder of its own, nothing of B's
    with Daemon([root_a], None, tmp_path / "d2.log", **env) as d2:
        status, st = d2.get("/v1/status")
        assert status == 200 and st["staging_dir"] != staging_b, st
        assert _jobs(d2) == []
    # A's daemon told to use B's folder: it leaves B's entry alone (logged), shows nothing of it
    with Daemon([root_a], Path(staging_b), tmp_path / "d3.log", **env) as d3:
        assert _jobs(d3) == []
        assert "of another root alone" in d3.logs()
    assert _lease_folders(staging_b) == leases_b
    # B's own daemon, restarted with the default, resumes the job and commits the step
    with Daemon([root_b], None, tmp_path / "d4.log", **env) as d4:
        wait_for(lambda: catalog.read_commit(store, 1) is not None, "B's step to commit", 120, logs=d4.logs)
        assert "resuming job" in d4.logs()
