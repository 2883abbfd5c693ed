"""The daemon's HTTP API against a real ``ckptd serve`` process: auth, roots, hand-off validation,
body limits, metrics, OpenAPI, and the client (``Checkpointer(daemon=...)``) in this process."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import torch

from ckptd import catalog
from ckptd.errors import CheckpointError
from storage_backends import open_store
from tests.server.daemon import Daemon, hand_off_body, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN = "s3cret-token"
BUDGET = 2 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("api")
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")
    root = str(base / "jobs")
    d = Daemon(
        [root],
        base / "staging",
        base / "daemon.log",
        token_file=token_file,
        CKPTD_MAX_BODY_BYTES="1048576",
        CKPTD_BUDGET=str(BUDGET),
    )
    with d:
        yield d, root


@pytest.fixture
def client(served):
    d, _ = served
    with d.client() as c:  # a trainer on the node: its socket
        yield c


def test_auth(served):
    d, root = served
    with httpx.Client(base_url=d.url, timeout=30) as c:
        assert c.get("/healthz").status_code == 200  # liveness needs no token
        for path in ("/v1/checkpoints", "/metrics", "/openapi.json", "/v1/status"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert c.get(path, headers={"Authorization": TOKEN}).status_code == 401, path  # no scheme
            assert c.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        r = c.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 1, "client": "x"})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"


def test_roots_outside_are_400(served, client):
    _, root = served
    assert client.post("/v1/roots/check", json={"root": root}).status_code == 200
    assert client.post("/v1/roots/check", json={"root": root + "/run-7"}).status_code == 200  # below a served root
    for bad in ("/elsewhere", root + "-evil", root + "/../etc", "relative/path", "s3://bucket/jobs", "file://host/x"):
        r = client.post("/v1/roots/check", json={"root": bad})
        assert r.status_code == 400, bad
        r = client.post("/v1/leases", json={"root": bad, "rank": 0, "bytes": 8, "client": "x"})
        assert r.status_code == 400, bad
        assert client.get("/v1/checkpoints", params={"root": bad}).status_code == 400, bad


def _lease(client, root, nbytes=64):
    r = client.post("/v1/leases", json={"root": root, "rank": 0, "bytes": nbytes, "client": "t"})
    assert r.status_code == 200, r.text
    return r.json()


def _job(lease, job_root, **over):
    metadata = [{"key": "arrays/w/zarr.json", "file": "m.bin"}, {"key": "manifest.json", "file": "man.bin"}]
    return hand_off_body(job_root, lease=lease["lease"], metadata=metadata) | over


def _stage_manifest(folder, shape=(4,), chunk=None, step=5, attempt="a1"):
    """man.bin: the manifest of a one-tensor checkpoint (the daemon commits nothing without
    one), and m.bin: the tensor's zarr.json."""
    from ckptd import manifest as mf
    from ckptd.codec import ArrayLayout

    layout = ArrayLayout(tuple(shape), "float32", tuple(shape), tuple(chunk or shape))
    m = mf.Manifest(step, 1, {"w": mf.TensorEntry("w", layout)}, {}, attempt)
    with open(os.path.join(folder, "man.bin"), "wb") as f:
        f.write(m.to_bytes())
    with open(os.path.join(folder, "m.bin"), "wb") as f:
        f.write(mf.dumps(layout.metadata()))


def test_handoff_validation(served, client, tmp_path):
    _, root = served
    lease = _lease(client, root)
    folder = lease["dir"]
    np.arange(4, dtype=np.float32).tofile(os.path.join(folder, "w.bin"))
    _stage_manifest(folder)
    secret = tmp_path / "secret.bin"
    np.zeros(4, dtype=np.float32).tofile(secret)
    os.symlink(secret, os.path.join(folder, "link.bin"))

    def shard(**kw):
        s = _job(lease, root)["shards"][0]
        s.update(kw)
        return [s]

    bad = {
        "path escaping the lease": {"shards": shard(file="../w.bin")},
        "absolute path": {"shards": shard(file=str(secret))},
        "symlink": {"shards": shard(file="link.bin")},
        "missing file": {"shards": shard(file="nope.bin")},
        "key escaping the root": {"shards": shard(key="../../../outside")},
        "wrong size": {
            "shards": shard(layout={"shape": [8], "dtype": "float32", "shard_shape": [8], "chunk_shape": [8]})
        },
        "coord outside grid": {"shards": shard(coord=[3])},
        "unknown dtype": {
            "shards": shard(layout={"shape": [4], "dtype": "object", "shard_shape": [4], "chunk_shape": [4]})
        },
        "commit record as metadata": {"metadata": [{"key": "commit.json", "file": "m.bin"}]},
        "done record as metadata": {"metadata": [{"key": "_done/a1/rank_000000.json", "file": "m.bin"}]},
        "metadata key escaping": {"metadata": [{"key": "../step_0000000001/commit.json", "file": "m.bin"}]},
        "root outside": {"root": "/elsewhere"},
        "rank outside world": {"rank": 3},
        "bad attempt": {"attempt": "../x"},
        "malformed": {"step": "five"},
    }
    for what, over in bad.items():
        r = client.post("/v1/jobs", json=_job(lease, root, **over))
        assert r.status_code == 400, (what, r.text)
    assert client.post("/v1/jobs", json=_job({"lease": "nope"}, root)).status_code == 404
    # nothing was written for any of them
    assert not any(True for _ in open_store(root).list(""))

    # a valid one commits; the same job id again is idempotent; the lease is busy meanwhile
    job = _job(lease, root, job="ab" * 16)
    r = client.post("/v1/jobs", json=job)
    assert r.status_code == 200, r.text
    assert client.post("/v1/jobs", json=job).json()["job"] == "ab" * 16
    wait_for(lambda: client.get(f"/v1/jobs/{'ab' * 16}").json()["state"] == "committed", "commit", 30)
    assert catalog.read_commit(open_store(root), 5)["attempt"] == "a1"
    assert client.get("/v1/jobs/nope").status_code == 404
    client.delete(f"/v1/leases/{lease['lease']}")


def test_body_limit(served, client):
    _, root = served
    big = {"root": root, "rank": 0, "bytes": 1, "client": "x" * 10, "pad": "x" * (2 << 20)}
    assert client.post("/v1/leases", json=big).status_code == 413

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 65536

    assert client.post("/v1/leases", content=chunks(), headers={"Content-Type": "application/json"}).status_code == 413


def test_openapi_and_metrics(served, client):
    spec = client.get("/openapi.json").json()
    for path in ("/healthz", "/v1/checkpoints", "/v1/checkpoints/{step}", "/metrics", "/v1/jobs", "/v1/leases"):
        assert path in spec["paths"], path
    text = client.get("/metrics").text
    for name in (
        "ckptd_bytes_written_total",
        "ckptd_objects_written_total",
        "ckptd_handoff_to_commit_seconds_sum",
        "ckptd_queue_depth",
        "ckptd_jobs_failed_total",
        "ckptd_upload_retries_total",
        "ckptd_staged_bytes",
    ):
        assert f"\n{name} " in text, name


def _state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return {"model": model, "extra": {"bf16": torch.randn(3, 5).bfloat16(), "i": torch.arange(7)}, "meta": {"s": seed}}


def test_client_in_process(served, client, monkeypatch):
    """Checkpointer(daemon=...) from this process: saves commit, the lease is reused across saves,
    retention (the job's keep_last) runs after each commit, restore is bitwise; a wrong token or root fails at once."""
    d, root = served
    job_root = root + "/client"
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    state = _state(0)
    with Checkpointer(job_root, daemon=d.socket_url, keep_last=2) as ck:
        for step in (1, 2, 3):
            res = ck.save(step, state).result()
            assert res.step == step and res.committed_here
        assert client.get("/v1/status").json()["leases"] == 1  # one lease, reused by every save
        assert ck.staged_bytes > 0
        # another client needs the whole budget: the idle lease is reclaimed, and this client
        # unmaps its files soon after (their memory is only freed then), without a save
        other = client.post("/v1/leases", json={"root": root, "rank": 0, "bytes": BUDGET, "client": "other"})
        assert other.status_code == 200, other.text
        wait_for(lambda: ck.staged_bytes == 0, "the client to unmap its reclaimed lease", 10)
        assert client.delete(f"/v1/leases/{other.json()['lease']}").status_code == 204
        assert ck.save(4, state).result().committed_here  # a fresh lease
    assert catalog.committed_steps(open_store(job_root)) == [3, 4]  # keep_last ran after the commits
    info = client.get("/v1/checkpoints/3", params={"root": job_root}).json()
    assert info["committed"] and {t["key"] for t in info["tensors"]} >= {"extra/bf16", "extra/i"}
    assert client.get("/v1/checkpoints/99", params={"root": job_root}).status_code == 404
    got = _state(1)
    with Checkpointer(job_root) as ck:
        assert ck.restore(got) == 4
    for (k, a), b in zip(state["model"].state_dict().items(), got["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(got["extra"]["bf16"], state["extra"]["bf16"]) and got["meta"] == {"s": 0}
    assert d.metric("ckptd_bytes_written_total", TOKEN) > 0

    monkeypatch.setenv("CKPTD_TOKEN", "wrong")
    with pytest.raises(CheckpointError, match="401"):
        Checkpointer(job_root, daemon=d.socket_url)
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    with pytest.raises(CheckpointError, match="not served"):
        Checkpointer(str(d.staging.parent / "other"), daemon=d.socket_url)


def test_restart_discards_a_job_whose_files_are_lost(tmp_path, monkeypatch):
    """Daemon killed mid-upload, a staging file lost meanwhile: the restarted daemon discards the
    job and says so; the step never commits; the client's future fails; the next save commits."""
    root = str(tmp_path / "job")
    staging = tmp_path / "staging"
    slow = Daemon([root], staging, tmp_path / "d1.log", upload_delay_s=2.0)
    slow.start()
    try:
        ck = Checkpointer(root, daemon=slow.socket_url, commit_timeout=120)
        fut = ck.save(1, _state(0))
        wait_for(lambda: [j["state"] for j in slow.get("/v1/jobs")[1]] == ["uploading"], "upload to start", 60)
        slow.kill()  # every put is sleeping its injected second: nothing is committed
        assert catalog.read_commit(open_store(root), 1) is None
        files = [p for p in staging.glob("leases/*/*.bin") if not p.name.startswith("meta")]
        assert files, "staged files survive the crash"
        files[0].unlink()
        d2 = Daemon([root], staging, tmp_path / "d2.log").start(port=slow.port)  # restarted in place
        try:
            with pytest.raises(CheckpointError, match="discarded"):
                fut.result(timeout=60)
            assert "discarding job" in d2.logs()
            assert catalog.read_commit(open_store(root), 1) is None
            assert d2.metric("ckptd_jobs_discarded_total") == 1
            assert ck.save(2, _state(0)).result().committed_here
            ck.close()
        finally:
            d2.stop()
        assert catalog.committed_steps(open_store(root)) == [2]
    finally:
        slow.kill()


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """A daemon with room for a few MiB of snapshots (object images are 1 MiB or more)."""
    base = tmp_path_factory.mktemp("images")
    root = str(base / "jobs")
    with Daemon([root], base / "staging", base / "daemon.log", CKPTD_BUDGET=str(64 << 20)) as d:
        yield d, root


def test_object_images_through_the_daemon(roomy, monkeypatch, tmp_path):
    """Shards of 1 MiB or more are staged as object images in the lease's files; the daemon
    writes them as the encoded objects (byte for byte), across saves that reuse the files."""
    from ckptd import manifest as mf
    from ckptd.codec import encode_shard
    from ckptd.verify import verify

    d, root = roomy
    job_root = root + "/images"
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    torch.manual_seed(0)
    state = {"w": torch.randn(1000, 1024), "e": torch.randn(2048, 300).bfloat16(), "b": torch.randn(7)}
    with Checkpointer(job_root, daemon=d.socket_url) as ck:
        ck.save(1, state).result()
        state["w"] += 1
        ck.save(2, state).result()
        staged = ck._stager
        assert {k for k, _ in staged._views} == {"w", "e"}  # "b" is 28 bytes: a plain buffer
        for k, (name, image) in staged._files.items():
            if k in staged._views:  # the lease file is the image: data, crc slots and index
                assert os.path.getsize(staged._dir / name) == image.nbytes > state[k[0]].nbytes
    store = open_store(job_root)
    m = catalog.load_manifest(store, 2)
    for key in ("w", "e"):
        layout = m.tensors[key].layout
        block = state[key].view(torch.int16).numpy() if key == "e" else state[key].numpy()
        for coord in layout.shard_coords():
            start, stop = layout.shard_box(coord)
            want = b"".join(bytes(b) for b in encode_shard(layout, coord, block[start[0] : stop[0]]))
            assert store.get(f"{mf.step_dir(2)}/{mf.array_path(key)}/{layout.shard_key(coord)}") == want
    assert verify(store, 2).ok
    got = {"w": torch.zeros(1000, 1024), "e": torch.zeros(2048, 300).bfloat16(), "b": torch.zeros(7)}
    with Checkpointer(job_root) as ck:
        assert ck.restore(got) == 2
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_the_daemon_writes_its_own_index_and_checksums_into_an_image(roomy, tmp_path):
    """A hand-off's image file carries the trainer's data; whatever its index and checksum slots
    hold, the object the daemon commits is the encoded data. An image on a layout that has none,
    or of the wrong size, is refused."""
    from ckptd import manifest as mf
    from ckptd.codec import ArrayLayout, encode_shard, image_nbytes

    d, root = roomy
    job_root = root + "/handmade"
    layout = ArrayLayout((512, 1024), "float32", (512, 1024), (16, 1024))  # 2 MiB in 32 chunks
    data = np.random.default_rng(0).random((512, 1024), dtype=np.float32)
    with d.client(timeout=30) as c:
        lease = _lease(c, job_root, nbytes=image_nbytes(layout, 32) + 4096)
        image = np.frombuffer(os.urandom(image_nbytes(layout, 32)), np.uint8).copy()  # garbage slots
        stride = layout.chunk_nbytes + 4
        raw = data.reshape(-1).view(np.uint8)
        for k in range(32):
            image[k * stride : k * stride + layout.chunk_nbytes] = raw[
                k * layout.chunk_nbytes : (k + 1) * layout.chunk_nbytes
            ]
        image.tofile(os.path.join(lease["dir"], "w.bin"))
        _stage_manifest(lease["dir"], (512, 1024), (16, 1024))
        lay = {"shape": [512, 1024], "dtype": "float32", "shard_shape": [512, 1024], "chunk_shape": [16, 1024]}
        shard = {"key": "w", "layout": lay, "coord": [0, 0], "file": "w.bin", "image": True}
        tiles = {**lay, "chunk_shape": [16, 512]}  # chunks are not whole rows: no image
        for why, s in {
            "has no object image": {**shard, "layout": tiles},
            "staging file has": {**shard, "layout": {**lay, "shape": [256, 1024], "shard_shape": [256, 1024]}},
        }.items():
            r = c.post("/v1/jobs", json=_job(lease, job_root, shards=[s]))
            assert r.status_code == 400 and why in r.text, r.text
        r = c.post("/v1/jobs", json=_job(lease, job_root, shards=[shard], job="cd" * 16))
        assert r.status_code == 200, r.text
        wait_for(lambda: c.get(f"/v1/jobs/{'cd' * 16}").json()["state"] == "committed", "commit", 30)
        c.delete(f"/v1/leases/{lease['lease']}")
    want = b"".join(bytes(b) for b in encode_shard(layout, (0, 0), data))
    assert open_store(job_root).get(f"{mf.step_dir(5)}/{mf.array_path('w')}/{layout.shard_key((0, 0))}") == want


def test_job_status_long_poll_answers_when_the_job_is_final(tmp_path):
    """``GET /v1/jobs/{id}?wait=S`` holds the answer until the job is final (the client's poller
    learns of a commit at once instead of on its next poll); without ``wait`` it answers now."""
    root = str(tmp_path / "jobs")
    with (
        Daemon([root], tmp_path / "staging", tmp_path / "daemon.log", upload_delay_s=1.5) as d,
        d.client(timeout=60) as c,
    ):
        lease = _lease(c, root)
        np.arange(4, dtype=np.float32).tofile(os.path.join(lease["dir"], "w.bin"))
        _stage_manifest(lease["dir"])
        job = "ef" * 16
        assert c.post("/v1/jobs", json=_job(lease, root, job=job)).status_code == 200
        assert c.get(f"/v1/jobs/{job}").json()["state"] in ("queued", "uploading")  # the put sleeps 1.5 s
        assert c.get(f"/v1/jobs/{job}", params={"wait": 0.2}).json()["state"] in ("queued", "uploading")  # timed out
        got = c.get(f"/v1/jobs/{job}", params={"wait": 30}).json()  # woken by the upload thread
        assert got["state"] == "committed" and got["committed_at"] is not None
        assert c.get(f"/v1/jobs/{job}", params={"wait": 61}).status_code == 400
        assert c.get("/v1/jobs/nope", params={"wait": 5}).status_code == 404


def test_a_client_uses_only_what_the_daemon_advertises(roomy, monkeypatch):
    """``/v1/status`` lists the daemon's features. A client facing a daemon without them (an
    older ``ckptd serve``: here its answer is withheld from the client) stages plain shard files
    and polls without ``wait``; its saves still commit and restore."""
    from trainer_hooks import daemon_sink

    d, root = roomy
    with d.client(timeout=30) as c:
        assert {"image_handoff", "job_long_poll"} <= set(c.get("/v1/status").json()["features"])
    monkeypatch.setattr(daemon_sink.DaemonSink, "_features", lambda self: set())
    torch.manual_seed(1)
    state = {"w": torch.randn(1000, 1024)}
    job_root = root + "/old-daemon"
    with Checkpointer(job_root, daemon=d.socket_url) as ck:
        assert ck.save(1, state).result().committed_here
        assert not ck._stager._views and ck._stager.images is False and ck._sink.long_poll is False
    got = {"w": torch.zeros(1000, 1024)}
    with Checkpointer(job_root) as ck:
        assert ck.restore(got) == 1
    assert torch.equal(got["w"], state["w"])
