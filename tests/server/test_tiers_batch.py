"""Batched tier reads with real daemons on loopback: a restoring rank fetches the shard objects a
tier holds in a few ``POST /v1/tiers/read`` requests (not one request per object), the batch
route answers exactly the bytes of the ranges it is asked for, concatenated, and refuses what a
single read refuses (no token, a range outside its object, a key or step it does not hold)."""

from __future__ import annotations

import http.client
import json
import os
from urllib.parse import quote, urlsplit

import pytest

from tests.distributed import launch
from tests.server.daemon import kill_all, wait_for
from tests.server.daemon import node as _daemon
from tests.server.test_tiers import TOKEN, _check, _run, _tiers, _url

pytestmark = pytest.mark.timeout(600)


def _post(url: str, path: str, body: dict, token: str | None = TOKEN) -> tuple[int, bytes, dict]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    r = conn.getresponse()
    out = (r.status, r.read(), {k.lower(): v for k, v in r.getheaders()})
    conn.close()
    return out


def _object(url: str, root: str, step: int, attempt: str, key: str, start: int, length: int) -> bytes:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    q = f"root={quote(root, safe='')}&step={step}&attempt={attempt}&key={quote(key, safe='')}"
    conn.request(
        "GET", f"/v1/tiers/object?{q}&start={start}&length={length}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    r = conn.getresponse()
    body = r.read()
    conn.close()
    assert r.status == 200, body
    return body


def test_tier_reads_are_batched(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    out = tmp_path / "out"
    pa, pc = launch.free_port(), launch.free_port()
    urls = [_url(pa), _url(pc)]
    a = _daemon(tmp_path, "a", root, pa, urls)
    c = _daemon(tmp_path, "c", root, pc, urls)
    procs = []
    try:
        _run(2, "save_steps", out / "s", daemons=[a.socket_url], root=root, steps=[1])
        wait_for(lambda: [r["step"] for r in _tiers(c)["replicas"]] == [1], "the replica on c", 120, (), c.logs)
        rep = _tiers(c)["replicas"][0]
        attempt = rep["attempt"]
        status, raw, _ = _post(c.url, "/v1/tiers/read", {"root": root, "step": 1, "attempt": attempt, "ranges": []})
        assert status == 400, raw  # at least one range
        code, body = c.get(f"/v1/tiers?root={quote(root, safe='')}&step=1&attempt={attempt}&keys=true", TOKEN)
        assert code == 200, body
        keys = sorted(body["replicas"][0]["keys"])
        assert len(keys) >= 4, keys

        # The batch answers the concatenation of exactly the ranges asked for.
        ranges = [{"key": k, "start": i, "length": 7} for i, k in enumerate(keys[:3])]
        ranges.append({"key": keys[0], "start": -4, "length": 4})
        status, raw, headers = _post(
            c.url, "/v1/tiers/read", {"root": root, "step": 1, "attempt": attempt, "ranges": ranges}
        )
        assert status == 200, raw
        assert headers["x-ckptd-step"] == "1" and headers["x-ckptd-attempt"] == attempt
        want = b"".join(_object(c.url, root, 1, attempt, r["key"], r["start"], r["length"]) for r in ranges)
        assert raw == want and len(raw) == 3 * 7 + 4

        # What a single read refuses, the batch refuses: no token, a range past an object's
        # end, a key it does not hold, another step or attempt.
        body = {"root": root, "step": 1, "attempt": attempt, "ranges": ranges}
        assert _post(c.url, "/v1/tiers/read", body, token=None)[0] == 401
        assert _post(c.url, "/v1/tiers/read", body, token="wrong")[0] == 401
        past = [*ranges, {"key": keys[0], "start": 0, "length": 1 << 20}]
        assert _post(c.url, "/v1/tiers/read", {**body, "ranges": past})[0] == 416
        unknown = [*ranges, {"key": "step_0000000001/arrays/../../x", "start": 0, "length": 1}]
        assert _post(c.url, "/v1/tiers/read", {**body, "ranges": unknown})[0] == 404
        assert _post(c.url, "/v1/tiers/read", {**body, "step": 2})[0] == 404
        assert _post(c.url, "/v1/tiers/read", {**body, "attempt": "other"})[0] == 404

        # A restore at 1 rank through c reads every shard from c's memory in one request per
        # CKPTD_TIER_BATCH_BYTES of small objects, one per coalesced range of a larger one
        # (before batching: one per shard object read and range, 44 here), bitwise.
        before = c.metric("ckptd_tier_object_requests_total", TOKEN)
        batch = 1 << 20
        env = {"CKPTD_TIER_BATCH_BYTES": str(batch), "CKPTD_TIER_SHARED_MEMORY": "0"}
        res = _run(
            1, "restore_tiered", out / "r1", env, daemon=c.socket_url, root=root, ref=str(out / "s" / "ref_step1.pt")
        )
        got = _check(res, 1)
        assert got["root"] == 0 and got["local"] > 0, got
        asked = c.metric("ckptd_tier_object_requests_total", TOKEN) - before
        # one request per `batch` bytes of shard objects (a batch closes past it: one more)
        assert 1 < asked <= got["local"] // batch + 2, (asked, got)

        # With a batch size under some shard objects' size, those are read one GET per range
        # straight into the tensors and the others batched: still every byte from c, bitwise.
        before = c.metric("ckptd_tier_object_requests_total", TOKEN)
        env = {"CKPTD_TIER_BATCH_BYTES": str(4 << 10), "CKPTD_TIER_SHARED_MEMORY": "0"}
        res = _run(
            1, "restore_tiered", out / "r1s", env, daemon=c.socket_url, root=root, ref=str(out / "s" / "ref_step1.pt")
        )
        small = _check(res, 1)
        assert small == got, (small, got)
        assert c.metric("ckptd_tier_object_requests_total", TOKEN) - before > asked
    finally:
        kill_all(procs)
        for d in (a, c):
            d.kill()
