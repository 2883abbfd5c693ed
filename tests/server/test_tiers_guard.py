"""The memory tier's guards: the replica protocol refuses what is not a whole, checksummed copy
of a step's shard objects; reads need the token and the exact step and attempt; a full staging
budget degrades to persist-only (a save never fails or waits for a copy); a lease that needs
room takes it from the tier's copies."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

import pytest

from ckptd.codec import crc32c
from ckptd.daemon_conn import PEER_HEADER, peer_auth
from ckptd.server.staging import Staging
from ckptd.server.tiers import Tiers, replica_targets
from tests import load
from tests.server import daemon as dm

TOKEN = "guard-test-token-0123456789"
KEY = "step_0000000002/arrays/model/w/c/0"


def _call(
    url: str, method: str, path: str, body: bytes | None = None, token: str | None = TOKEN, ctype="application/json"
):
    req = urllib.request.Request(url + path, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if path.startswith("/v1/tiers/replicas"):  # signed as a peer daemon (``peer_auth``)
        req.add_header(PEER_HEADER, peer_auth(dm.PEER_KEY.encode(), "http://peer", method, path, body))
    req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def _begin(url: str, root: str, objects: list[dict], token: str | None = TOKEN):
    body = {"root": root, "step": 2, "attempt": "att1", "ranks": [0], "objects": objects}
    return _call(url, "POST", "/v1/tiers/replicas", json.dumps(body).encode(), token)


def _push(url: str, root: str, data: bytes, crc: int) -> tuple[int, bytes]:
    status, raw, _ = _begin(url, root, [{"key": KEY, "size": len(data), "crc32c": crc}])
    assert status == 200, raw
    rid = json.loads(raw)["replica"]
    q = f"/v1/tiers/replicas/{rid}?key={urllib.parse.quote(KEY, safe='')}&offset=0"
    status, raw, _ = _call(url, "PUT", q, data, ctype="application/octet-stream")
    assert status == 200, raw
    status, raw, _ = _call(url, "POST", f"/v1/tiers/replicas/{rid}/seal", b"{}")
    return status, raw


def _read(url: str, root: str, attempt: str = "att1", start: int = 0, length: int = 8):
    q = urllib.parse.urlencode(
        {"root": root, "step": 2, "attempt": attempt, "key": KEY, "start": start, "length": length}
    )
    return _call(url, "GET", f"/v1/tiers/object?{q}")


def test_replica_protocol_and_reads_refuse_what_is_not_the_committed_copy(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    root = f"file://{tmp_path / 'job'}"
    key = dm.peer_key_file(tmp_path)
    with dm.Daemon(
        [root], tmp_path / "staging", tmp_path / "d.log", token_file=token, CKPTD_PEER_KEY_FILE=str(key)
    ) as d:
        obj = [{"key": KEY, "size": 8, "crc32c": crc32c(b"12345678")}]
        # No token, a wrong token: refused before anything is read or held.
        assert _begin(d.url, root, obj, token=None)[0] == 401
        assert _begin(d.url, root, obj, token="nope")[0] == 401
        # Not a shard object of the step: metadata, another step, a path climbing out.
        for bad in ("step_0000000002/manifest.json", "step_0000000003/arrays/x/c/0", "step_0000000002/arrays/../../x"):
            status, raw, _ = _begin(d.url, root, [{"key": bad, "size": 1, "crc32c": 0}])
            assert status == 400, (bad, raw)
        # A root this daemon does not serve.
        assert _begin(d.url, f"file://{tmp_path / 'other'}", obj)[0] == 400
        # Bytes that do not match the announced crc32c: the seal fails, nothing is served.
        status, raw = _push(d.url, root, b"abcdefgh", crc32c(b"12345678"))
        assert status == 400 and b"crc32c" in raw, raw
        assert _read(d.url, root)[0] == 404
        # A piece of an object the replica does not have, or out of order: refused.
        status, raw, _ = _begin(d.url, root, obj)
        rid = json.loads(raw)["replica"]
        assert _call(d.url, "PUT", f"/v1/tiers/replicas/{rid}?key=other&offset=0", b"x", ctype="x/y")[0] == 400
        q = f"/v1/tiers/replicas/{rid}?key={urllib.parse.quote(KEY, safe='')}&offset=4"
        assert _call(d.url, "PUT", q, b"5678", ctype="x/y")[0] == 400
        # The whole, matching copy: served for exactly its step and attempt, in range.
        status, raw = _push(d.url, root, b"12345678", crc32c(b"12345678"))
        assert status == 200, raw
        status, body, headers = _read(d.url, root, start=2, length=4)
        assert status == 200 and body == b"3456", body
        assert headers["X-Ckptd-Step"] == "2" and headers["X-Ckptd-Attempt"] == "att1"
        assert _read(d.url, root, start=-3, length=3)[1] == b"678"
        assert _read(d.url, root, attempt="att0")[0] == 404  # a stale attempt of the same step
        assert _read(d.url, root, start=4, length=8)[0] == 416
        q = urllib.parse.urlencode({"root": root, "step": 2, "attempt": "att1"})
        status, raw, _ = _call(d.url, "GET", f"/v1/tiers?{q}&keys=true")
        assert list(json.loads(raw)["replicas"][0]["keys"]) == [KEY]
        assert _call(d.url, "GET", f"/v1/tiers?{q}&keys=true", token=None)[0] == 401


def test_full_budget_degrades_to_persist_only(tmp_path):
    root = f"file://{tmp_path / 'job'}"
    out = tmp_path / "out"
    with dm.Daemon([root], tmp_path / "staging", tmp_path / "d.log", CKPTD_BUDGET="4096") as d:
        res = dm.run(1, "save_and_wait", out, daemons=[d.socket_url], root=root, step=1)
        assert res[0]["committed_here"] is True  # the save committed
        assert d.metric("ckptd_tier_degraded_total") >= 1
        assert d.metric("ckptd_tier_hot_bytes") == 0
        status, body = d.get("/v1/tiers")
        assert status == 200 and body["hot"] == [], body
        assert "persist-only" in d.logs()


def test_a_lease_reclaims_the_tiers_memory(tmp_path):
    staging = Staging(tmp_path / "staging", budget=1000)
    try:
        tiers = Tiers(staging, [], None, 0, None)
        tiers.share = 1.0  # one origin, 60% of the budget: the reclaim rule alone (--tenant-share 1)
        tee = tiers.recorder("file:///job", 5, "att", 0)
        tee("step_0000000005/arrays/w/c/0", b"x" * 600)
        tee("step_0000000005/manifest.json", b"{}")  # not a shard object: not copied
        tiers.committed("file:///job", 5, "att")
        assert tiers.keys("file:///job", 5, "att") == ["step_0000000005/arrays/w/c/0"]
        assert staging.reserved_bytes == 600
        # A save needs 700 bytes: the hot copy is dropped for it, no 429, no wait.
        lease = staging.create("file:///job", 0, 700, 700, "client-1")
        assert lease.bytes == 700
        assert staging.reserved_bytes == 0
        assert tiers.keys("file:///job", 5, "att") == []
        # Now a copy does not fit: the next step is persist-only on this node.
        tee = tiers.recorder("file:///job", 6, "att", 0)
        tee("step_0000000006/arrays/w/c/0", b"y" * 600)
        tiers.committed("file:///job", 6, "att")
        assert tiers.keys("file:///job", 6, "att") == []
        assert tiers.counters["degraded"] >= 2
    finally:
        staging.close()


def test_replica_targets_follow_the_ring():
    ring = ["http://a:1", "http://b:1", "http://c:1"]
    assert replica_targets(ring, "http://b:1", 1) == ["http://c:1"]
    assert replica_targets(ring, "http://c:1/", 2) == ["http://a:1", "http://b:1"]
    assert replica_targets(ring, None, 1) == ["http://a:1"]
    assert replica_targets(ring, "http://a:1", 5) == ["http://b:1", "http://c:1"]
    assert replica_targets(ring, "http://a:1", 0) == []


def test_a_reader_refuses_bytes_of_another_step_or_attempt():
    """A peer that answers with bytes of another attempt (a stale copy of the same step) or of
    the wrong length is refused by the reading rank, whatever the bytes."""
    import http.server
    import threading

    from trainer_hooks.tiered import TierStore, TierUnavailable

    answer = {"attempt": "att1", "body": b"12345678"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("X-Ckptd-Step", "2")
            self.send_header("X-Ckptd-Attempt", answer["attempt"])
            self.send_header("Content-Length", str(len(answer["body"])))
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        store = TierStore(url, "peer", "file:///job", 2, "att1", None, 5.0)
        assert store.get_range(KEY, 0, 8) == b"12345678"
        answer["attempt"] = "att0"
        with pytest.raises(TierUnavailable, match="another step or attempt"):
            store.get_range(KEY, 0, 8)
        answer["attempt"], answer["body"] = "att1", b"1234"
        with pytest.raises(TierUnavailable, match="4 bytes where 8"):
            store.get_range(KEY, 0, 8)
        answer["body"] = b"x" * 100
        with pytest.raises(TierUnavailable, match="at most 8"):
            store.get_range(KEY, 0, 8)
    finally:
        server.shutdown()
        server.server_close()


def test_a_hot_copy_dropped_for_room_takes_later_puts_silently(tmp_path):
    """A lease reclaims a hot copy while its upload still puts: the rest of its puts are not
    kept and count no further drop (one per copy, not one per object)."""
    staging = Staging(tmp_path / "staging", budget=1000)
    try:
        tiers = Tiers(staging, [], None, 0, None)
        tee = tiers.recorder("file:///job", 5, "att", 0)
        tee("step_0000000005/arrays/w/c/0", b"x" * 600)
        staging.create("file:///job", 0, 700, 700, "client-1")  # takes the copy's room
        assert tiers.counters["degraded"] == 1
        for i in range(1, 4):
            tee(f"step_0000000005/arrays/w/c/{i}", b"y" * 10)
        assert tiers.counters["degraded"] == 1
        tiers.committed("file:///job", 5, "att")
        assert tiers.keys("file:///job", 5, "att") == [] and staging.reserved_bytes == 0
    finally:
        staging.close()
