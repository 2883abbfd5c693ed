"""The daemon's one error table (``ckptd.server.app.ERRORS``): each error type raised below the
routes comes out as its status code and ``{"detail": ...}``, in this process (``TestClient``, the
real app and real files; no daemon process needed)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ckptd.server.app import ROUTERS, create_app
from ckptd.server.settings import Settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path, monkeypatch):
    # The table's mapping, in this process: no daemon, no token (``Settings`` reads the one the
    # suite's fixture names in CKPTD_TOKEN_FILE, and TestClient's calls come over "TCP").
    monkeypatch.delenv("CKPTD_TOKEN_FILE", raising=False)
    root = tmp_path / "jobs"
    root.mkdir()
    settings = Settings(roots=[str(root)], staging_dir=str(tmp_path / "staging"), budget=1 << 20)
    with TestClient(create_app(settings)) as c:
        yield c, root


def test_each_error_type_maps_to_its_status(served):
    c, root = served
    r = c.post("/v1/roots/check", json={"root": "/not/served"})  # RootError
    assert r.status_code == 400 and "is not served by this daemon" in r.json()["detail"]
    r = c.post("/v1/roots/check", json={})  # RequestValidationError
    assert r.status_code == 400 and r.json()["detail"] == "malformed request: body.root: Field required"
    r = c.post("/v1/leases/nope/heartbeat")  # LeaseGone, a KeyError: its message is not quoted again
    assert r.status_code == 404 and r.json()["detail"].startswith("no staging lease 'nope'")
    lease = c.post("/v1/leases", json={"root": str(root), "rank": 0, "bytes": 10, "client": "a"}).json()["lease"]
    job = {"lease": lease, "root": str(root), "step": 1, "attempt": "a1", "rank": 3, "world_size": 1, "shards": []}
    r = c.post("/v1/jobs", json=job)  # BadJob
    assert r.status_code == 400 and r.json() == {"detail": "rank 3 is outside world size 1"}
    (root / "step_0000000005").mkdir()
    (root / "step_0000000005" / "commit.json").write_text("{not json")
    for path in ("/v1/checkpoints", "/v1/checkpoints/5"):  # CheckpointError: the root, not the request
        r = c.get(path)
        assert r.status_code == 502 and "commit record is not valid JSON" in r.json()["detail"], path


def test_budget_full_is_429_with_retry_after_and_counted(served):
    c, root = served
    r = c.post("/v1/leases", json={"root": str(root), "rank": 0, "bytes": 100, "client": "a"})
    assert r.status_code == 200
    r = c.post("/v1/leases", json={"root": str(root), "rank": 1, "bytes": 2 << 20, "client": "b"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json() | {"detail": None} == {"detail": None, "staged": 100, "budget": 1 << 20}
    assert "ckptd_budget_waits_total 1" in c.get("/metrics").text


def test_every_route_comes_from_a_router(tmp_path):
    """Adding a group of routes is one entry in ROUTERS: nothing is declared on the app itself."""
    app = create_app(Settings(roots=[str(tmp_path)], staging_dir=str(tmp_path / "staging"), budget=1 << 20))
    ours = {(r.path, m.lower()) for router in ROUTERS for r in router.routes for m in r.methods}
    served = {(path, m) for path, ops in app.openapi()["paths"].items() for m in ops}
    assert served == ours and {("/healthz", "get"), ("/v1/jobs", "post")} <= ours
