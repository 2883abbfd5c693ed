"""What the daemon commits, tried with crafted hand-offs against a real ``ckptd serve`` on
loopback: a committed step is never written again (409, before a byte is written); a job
commits only with a complete manifest of its attempt whose tensors all have their data; steps
have at most 10 digits; retention is the daemon's setting, never the request's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout
from ckptd.verify import verify
from storage_backends import open_store
from tests.server.daemon import Daemon, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LAY = {"shape": [4], "dtype": "float32", "shard_shape": [4], "chunk_shape": [4]}
LAYOUT = ArrayLayout((4,), "float32", (4,), (4,))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("rules")
    root = str(base / "jobs")
    with Daemon([root], base / "staging", base / "daemon.log") as d:
        yield d, root


@pytest.fixture
def client(served):
    d, _ = served
    with httpx.Client(base_url=d.url, timeout=30) as c:
        yield c


def folder_digest(root: str, step: int) -> dict[str, str]:
    base = Path(root) / mf.step_dir(step)
    return {
        str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()
    }


def hand_off(client, root, step, attempt, *, value=1.0, tensors=("w",), shards=("w",), manifest=True, **over):
    """One rank's hand-off of a world of one: shards of ``shards`` (4 floats each, all
    ``value``), and a manifest naming ``tensors``. Returns the HTTP response."""
    r = client.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 4096, "client": "t"})
    assert r.status_code == 200, r.text
    lease = r.json()
    folder = lease["dir"]
    body = {
        "lease": lease["lease"],
        "root": root,
        "step": step,
        "attempt": attempt,
        "rank": 0,
        "world_size": 1,
        "shards": [],
        "metadata": [],
    }
    for key in shards:
        np.full(4, value, dtype=np.float32).tofile(os.path.join(folder, f"{key}.bin"))
        body["shards"].append({"key": key, "layout": LAY, "coord": [0], "file": f"{key}.bin"})
    if manifest:
        m = mf.Manifest(step, 1, {k: mf.TensorEntry(k, LAYOUT) for k in tensors}, {}, attempt)
        for i, (key, data) in enumerate([(f"arrays/{k}/zarr.json", mf.dumps(LAYOUT.metadata())) for k in tensors]):
            Path(folder, f"z{i}.bin").write_bytes(data)
            body["metadata"].append({"key": key, "file": f"z{i}.bin"})
        Path(folder, "manifest.bin").write_bytes(m.to_bytes())
        body["metadata"].append({"key": mf.MANIFEST, "file": "manifest.bin"})
    body.update(over)
    return client.post("/v1/jobs", json=body)


def final_state(client, job_id: str) -> dict:
    def done():
        return client.get(f"/v1/jobs/{job_id}").json()["state"] in ("committed", "failed")

    wait_for(done, f"job {job_id}", 60)
    return client.get(f"/v1/jobs/{job_id}").json()


def test_a_committed_step_is_refused_before_a_byte_is_written(served, client):
    _, root = served
    r = hand_off(client, root + "/immutable", 5, "a1", value=1.0)
    assert r.status_code == 200, r.text
    assert final_state(client, r.json()["job"])["state"] == "committed"
    before = folder_digest(root + "/immutable", 5)
    # a new attempt at the committed step, with other values: refused, nothing touched
    r = hand_off(client, root + "/immutable", 5, "a2", value=7.0)
    assert r.status_code == 409, r.text
    assert "already committed" in r.json()["detail"]
    assert folder_digest(root + "/immutable", 5) == before
    store = open_store(root + "/immutable")
    assert catalog.read_commit(store, 5)["attempt"] == "a1"
    assert verify(store, 5).ok


def test_a_commit_needs_the_manifest_and_every_tensor_data(served, client):
    _, root = served
    job_root = root + "/incomplete"
    r = hand_off(client, job_root, 6, "a1", manifest=False)
    assert r.status_code == 200, r.text
    st = final_state(client, r.json()["job"])
    assert st["state"] == "failed" and "manifest.json is missing" in st["error"], st
    r = hand_off(client, job_root, 7, "a1", tensors=("w", "v"), shards=("w",))  # v has no data
    assert r.status_code == 200, r.text
    st = final_state(client, r.json()["job"])
    assert st["state"] == "failed" and "no rank wrote 1 shard objects" in st["error"], st
    store = open_store(job_root)
    assert catalog.committed_steps(store) == []
    assert catalog.latest_step(store) is None


def test_steps_are_bounded_to_ten_digits(served, client):
    _, root = served
    job_root = root + "/bounds"
    for step in (10**10, 10**40):
        r = hand_off(client, job_root, step, "a1")
        assert 400 <= r.status_code < 500, r.text
    assert not any(True for _ in open_store(job_root).list(""))
    r = hand_off(client, job_root, 10**10 - 1, "a1")
    assert r.status_code == 200, r.text
    assert final_state(client, r.json()["job"])["state"] == "committed"


def test_a_request_cannot_set_retention(served, client):
    _, root = served
    job_root = root + "/retention"
    for step in (1, 2, 3):
        r = hand_off(client, job_root, step, "a1", keep_last=1)
        assert r.status_code == 200, r.text
        assert final_state(client, r.json()["job"])["state"] == "committed"
    assert catalog.committed_steps(open_store(job_root)) == [1, 2, 3]  # the history is all there
