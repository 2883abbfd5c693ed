"""What the daemon commits, tried with crafted hand-offs against a real ``ckptd serve`` on
loopback: a committed step is never written again (409, before a byte is written); a job
commits only with a complete manifest of its attempt whose tensors all have their data; steps
have at most 10 digits; retention is the daemon's setting, never the request's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from ckptd import catalog, claims
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout
from ckptd.verify import verify
from storage_backends import open_store
from tests.server.daemon import Daemon, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LAY = {"shape": [4], "dtype": "float32", "shard_shape": [4], "chunk_shape": [4]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("rules")
    root = str(base / "jobs")
    with Daemon([root], base / "staging", base / "daemon.log") as d:
        yield d, root


@pytest.fixture
def client(served):
    d, _ = served
    with d.client() as c:
        yield c


def folder_digest(root: str, step: int) -> dict[str, str]:
    base = Path(root) / mf.step_dir(step)
    return {
        str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()
    }


def hand_off(
    client,
    root,
    step,
    attempt,
    *,
    rank=0,
    world_size=1,
    value=1.0,
    tensors=("w",),
    shards=("w",),
    manifest=None,
    **over,
):
    """One rank's hand-off (a world of one by default): shards of ``shards`` (4 floats each, all
    ``value``; rank r holds elements [4r, 4r + 4) of each tensor), and (rank 0 by default) a
    manifest naming ``tensors``. Returns the HTTP response."""
    lay = {**LAY, "shape": [4 * world_size]}
    layout = ArrayLayout((4 * world_size,), "float32", (4,), (4,))
    r = client.post("/v1/leases", json={"root": root, "rank": rank, "bytes": 4096, "client": "t"})
    assert r.status_code == 200, r.text
    lease = r.json()
    folder = lease["dir"]
    body = {
        "lease": lease["lease"],
        "root": root,
        "step": step,
        "attempt": attempt,
        "rank": rank,
        "world_size": world_size,
        "shards": [],
        "metadata": [],
    }
    for key in shards:
        np.full(4, value, dtype=np.float32).tofile(os.path.join(folder, f"{key}.bin"))
        body["shards"].append({"key": key, "layout": lay, "coord": [rank], "file": f"{key}.bin"})
    if manifest if manifest is not None else rank == 0:
        m = mf.Manifest(step, world_size, {k: mf.TensorEntry(k, layout) for k in tensors}, {}, attempt)
        for i, (key, data) in enumerate([(f"arrays/{k}/zarr.json", mf.dumps(layout.metadata())) for k in tensors]):
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


def test_the_ranks_a_daemon_serves_share_one_claim_of_the_step(served, client):
    """Four ranks of one attempt hand off to one daemon: its first job claims the step
    (``claims.begin``), the others wait for that claim and share it -- one claim record and one
    begin for the attempt (before: one begin per job, 4; ~3 requests each on the step)."""
    d, root = served
    job_root = root + "/shared"
    before = d.metric("ckptd_step_claims_total")
    jobs = []
    for rank in range(4):
        r = hand_off(client, job_root, 8, "a1", rank=rank, world_size=4, value=float(rank), writer="job-a")
        assert r.status_code == 200, r.text
        jobs.append(r.json()["job"])
    assert [final_state(client, j)["state"] for j in jobs] == ["committed"] * 4
    store = open_store(job_root)
    assert catalog.read_commit(store, 8)["attempt"] == "a1"
    assert [rec["attempt"] for _, rec in claims.claims(store, 8)] == ["a1"]
    assert d.metric("ckptd_step_claims_total") - before == 1
    assert verify(store, 8).ok


def test_every_rank_of_a_refused_attempt_gets_the_one_refusal(served, client):
    """Another job is writing the step: every rank's job through the daemon fails with the same
    StepClaimed naming that job, from one claim, and writes nothing but the other job's claim
    is in the step (no retry of a refusal either)."""
    d, root = served
    job_root = root + "/taken"
    store = open_store(job_root)
    claims.begin(store, 9, "theirs", "job-other")  # job-other claimed step 9 just now
    before = d.metric("ckptd_step_claims_total"), d.metric("ckptd_upload_retries_total")
    jobs = []
    for rank in range(4):
        r = hand_off(client, job_root, 9, "a1", rank=rank, world_size=4, writer="job-a")
        assert r.status_code == 200, r.text
        jobs.append(r.json()["job"])
    states = [final_state(client, j) for j in jobs]
    assert {st["state"] for st in states} == {"failed"}, states
    errors = {st["error"] for st in states}
    assert len(errors) == 1, errors  # word for word: one claim decided it for all
    assert "being written by job 'job-other'" in errors.pop()
    assert d.metric("ckptd_step_claims_total") - before[0] == 1
    assert d.metric("ckptd_upload_retries_total") == before[1]
    assert sorted(o.key for o in store.list("")) == [claims.claim_key(9, 0)]


def test_a_failed_claim_is_not_shared_the_next_job_claims_again(served, client):
    """A claim that fails on storage (here a file where the step's claims folder goes, so every
    claim put fails) is no outcome: each upload retry claims again, and after the fault is
    gone the next job of the same attempt claims again and commits."""
    d, root = served
    job_root = root + "/blocked"
    folder = Path(job_root) / mf.step_dir(10)
    folder.mkdir(parents=True)
    (folder / mf.CLAIMS).write_text("in the way")
    claims0, retries0 = d.metric("ckptd_step_claims_total"), d.metric("ckptd_upload_retries_total")
    r = hand_off(client, job_root, 10, "a1", writer="job-a")
    assert r.status_code == 200, r.text
    st = final_state(client, r.json()["job"])
    assert st["state"] == "failed" and "cannot claim step 10" in st["error"], st
    retries = d.metric("ckptd_upload_retries_total") - retries0
    assert retries >= 1
    assert d.metric("ckptd_step_claims_total") - claims0 == retries + 1  # every try claimed again
    (folder / mf.CLAIMS).unlink()
    r = hand_off(client, job_root, 10, "a1", writer="job-a")
    assert r.status_code == 200, r.text
    assert final_state(client, r.json()["job"])["state"] == "committed"
    assert d.metric("ckptd_step_claims_total") - claims0 == retries + 2
    assert len(claims.claims(open_store(job_root), 10)) == 1
