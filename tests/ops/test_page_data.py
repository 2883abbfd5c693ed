"""The status page's data routes in this process (``TestClient``, the real app, real files):
escaping of names from storage, the token, paging and the row cache with hundreds of steps."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from ckptd import manifest as mf
from ckptd.server.app import create_app
from ckptd.server.settings import Settings

pytestmark = pytest.mark.timeout(120)
EVIL = 'x"\'><img src=x onerror="alert(1)">'


def _commit(root, step: int, world_size: int = 2) -> None:
    folder = root / mf.step_dir(step)
    folder.mkdir(parents=True)
    rec = {"step": step, "attempt": "a", "world_size": world_size, "bytes": 1000 + step, "time": 1.7e9 + step}
    (folder / mf.COMMIT).write_text(json.dumps(rec))


def _client(tmp_path, root, token=None) -> TestClient:
    token_file = None
    if token:
        token_file = tmp_path / "token"
        token_file.write_text(token)
    settings = Settings(
        roots=[str(root)],
        staging_dir=str(tmp_path / "staging"),
        budget=1 << 20,
        token_file=str(token_file) if token_file else None,
    )
    return TestClient(create_app(settings), headers={"X-Ckptd-Page": "1"})  # as the page's script sends


def test_names_from_storage_are_escaped(tmp_path):
    root = tmp_path / EVIL
    _commit(root, 3)
    (root / mf.step_dir(4)).mkdir()
    (root / mf.step_dir(4) / "junk").write_bytes(b"12345")
    with _client(tmp_path, root) as c:
        frag = c.get("/v1/page").json()["html"]
    assert "<img" not in frag and 'onerror="' not in frag
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in frag
    assert 'data-root="' + str(tmp_path).replace('"', "&quot;") in frag
    assert re.search(r'class="newest">3<', frag)


def test_shell_is_public_and_data_needs_the_token(tmp_path):
    with _client(tmp_path, tmp_path / "jobs", token="t0k") as c:
        r = c.get("/")
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
        assert "tokenform" in r.text and "t0k" not in r.text
        assert c.get("/static/status.js").status_code == 200
        assert c.get("/static/other.js").status_code == 401  # only the shell's own files are public
        for path in ("/v1/page", "/v1/overview"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer t0k"}).status_code == 200
        assert c.post("/v1/page/verify", params={"root": str(tmp_path), "step": 1}).status_code == 401


def test_hundreds_of_steps_page_and_cache(tmp_path):
    root = tmp_path / "jobs"
    for s in range(1, 301):
        _commit(root, s)
    with _client(tmp_path, root) as c:
        doc = c.get("/v1/overview").json()
        r = doc["roots"][0]
        assert r["count"] == 300 and r["newest_good_step"] == 300
        assert [x["step"] for x in r["checkpoints"]] == list(range(300, 275, -1))
        older = c.get("/v1/overview", params={"root": str(root), "offset": 275, "limit": 50}).json()["roots"][0]
        assert [x["step"] for x in older["checkpoints"]] == list(range(25, 0, -1))
        assert 'data-action="page"' in c.get("/v1/page").json()["html"]
        # committed rows are immutable, so they are cached: a rewritten record is not re-read...
        (root / mf.step_dir(300) / mf.COMMIT).write_text(json.dumps({"world_size": 99}))
        # ...while a new step and a deleted one show at the next refresh
        _commit(root, 301, world_size=7)
        (root / mf.step_dir(299) / mf.COMMIT).unlink()
        (root / mf.step_dir(299)).rmdir()
        rows = c.get("/v1/overview").json()["roots"][0]["checkpoints"]
        assert [(x["step"], x["world_size"]) for x in rows[:3]] == [(301, 7), (300, 2), (298, 2)]


def test_verify_marks_rows_and_moves_the_newest_good_step(tmp_path):
    import torch

    from trainer_hooks import Checkpointer

    root = tmp_path / "jobs"
    with Checkpointer(str(root)) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.arange(64, dtype=torch.float32) + step}).result()
    shard = next(p for p in (root / mf.step_dir(2) / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with _client(tmp_path, root) as c:
        assert c.get("/v1/overview").json()["roots"][0]["newest_good_step"] == 2
        r = c.post("/v1/page/verify", params={"root": str(root), "step": 1})
        assert r.status_code == 200 and r.json()["ok"] is True
        r = c.post("/v1/page/verify", params={"root": str(root), "step": 2})
        assert r.status_code == 200 and r.json()["ok"] is False and "crc32c" in r.json()["errors"][0]
        doc = c.get("/v1/overview").json()["roots"][0]
        assert [(x["step"], x["state"]) for x in doc["checkpoints"]] == [(2, "corrupt"), (1, "verified")]
        assert doc["newest_good_step"] == 1
        assert c.post("/v1/page/verify", params={"root": str(root), "step": 9}).status_code == 404
        assert c.post("/v1/page/verify", params={"root": "/elsewhere", "step": 1}).status_code == 400
