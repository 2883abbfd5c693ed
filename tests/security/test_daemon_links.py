"""Issue 27 item 6: a link planted below the daemon's served root never lets a request reach
outside it. ``served/link -> theirs``: listing, showing, verifying and handing off for
``served/link/theirjob`` are refused (400) and nothing outside the served root is read or
written; a link planted after the check is not followed by the store either (``O_NOFOLLOW`` on
every level below the served root). A real daemon, real links."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ckptd import catalog
from ckptd.server.roots import Roots
from storage_backends import StorageError, open_store
from tests.security.conftest import make_root
from tests.server.daemon import Daemon, wait_for
from tests.server.test_api import _job, _stage_manifest

pytestmark = [pytest.mark.timeout(240)]


def _tree(path) -> list[tuple[str, int]]:
    out = []
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(d, n)
            out.append((p, os.lstat(p).st_mtime_ns))
    return sorted(out)


def test_a_link_below_the_served_root_is_refused_on_every_route(tmp_path):
    served, theirs = tmp_path / "jobs", tmp_path / "theirs"
    served.mkdir()
    make_root(theirs / "theirjob", steps=(1,))
    os.symlink(theirs, served / "link")
    before = _tree(theirs)
    evil = f"{served}/link/theirjob"
    daemon = Daemon([str(served)], tmp_path / "staging", tmp_path / "daemon.log")
    with daemon as d, d.client(headers={"X-Ckptd-Page": "1"}) as c:
        for r in (
            c.get("/v1/checkpoints", params={"root": evil}),
            c.get("/v1/checkpoints/1", params={"root": evil}),
            c.get("/v1/overview", params={"root": evil}),
            c.get("/v1/page", params={"root": evil}),
            c.post("/v1/page/verify", params={"root": evil, "step": 1}),
            c.post("/v1/roots/check", json={"root": evil}),
            c.post("/v1/leases", json={"root": evil, "rank": 0, "bytes": 64, "client": "t"}),
            c.post("/v1/leases", json={"root": f"file://{evil}/new", "rank": 0, "bytes": 64, "client": "t"}),
        ):
            assert r.status_code == 400, (r.request.url, r.status_code, r.text)
            assert "symbolic link" in r.json()["detail"], r.text
        # a hand-off with a lease on a good root that names the linked root: refused, and a
        # good root below the served one (levels missing until now) still commits
        good = f"{served}/team/run-1"
        r = c.post("/v1/leases", json={"root": good, "rank": 0, "bytes": 64, "client": "t"})
        assert r.status_code == 200, r.text
        lease = r.json()
        np.arange(4, dtype=np.float32).tofile(os.path.join(lease["dir"], "w.bin"))
        _stage_manifest(lease["dir"])
        for root in (evil, f"{evil}/deeper"):
            r = c.post("/v1/jobs", json=_job(lease, root))
            assert r.status_code == 400 and "symbolic link" in r.text, r.text
        assert c.post("/v1/jobs", json=_job(lease, good, job="aa" * 16)).status_code == 200
        wait_for(lambda: c.get(f"/v1/jobs/{'aa' * 16}").json()["state"] == "committed", "commit", 60)
        assert c.get("/v1/checkpoints", params={"root": good}).json()[0]["step"] == 5
    assert catalog.committed_steps(open_store(good)) == [5]
    assert _tree(theirs) == before  # nothing outside the served root was written


def test_the_daemon_store_never_follows_a_link_planted_after_the_check(tmp_path):
    """The check passed while ``served/team`` was a folder; it then became a link: the store the
    daemon holds for ``served/team/run`` reads nothing through it and writes nothing through it."""
    served, theirs = tmp_path / "jobs", tmp_path / "theirs"
    (served / "team").mkdir(parents=True)
    make_root(theirs / "run", steps=(1,))
    roots = Roots([str(served)])
    root = f"{served}/team/run"
    assert roots.check(root) == root
    store = roots.open_store(root)
    (served / "team").rmdir()
    os.symlink(theirs, served / "team")
    before = _tree(theirs)
    assert list(store.list("")) == []
    assert not store.exists_root()
    with pytest.raises(StorageError):
        store.get("step_0000000001/commit.json")
    with pytest.raises(StorageError):
        store.put("step_0000000002/x", b"data")
    assert _tree(theirs) == before
    # the served root itself may be a link: the operator chose it
    linked = tmp_path / "linked-served"
    os.symlink(served, linked)
    (served / "team").unlink()
    ok = Roots([str(linked)]).open_store(f"{linked}/team/run")
    ok.put("k", b"v")
    assert (served / "team" / "run" / "k").read_bytes() == b"v"
