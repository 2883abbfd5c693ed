"""Hostile numbers and nesting against a real ``ckptd serve`` run as the docs print it (a token
file, its Unix socket, no ``--trust-tcp``):

* every number a request carries is bounded: ``10^400``, ``2^63``, ``1e400`` and negatives in
  bodies, query and path parameters get a 4xx, and afterwards ``/metrics``, the status page and
  its data keep answering 200 (before, one ``POST /v1/tiers/restored`` with ``10^400`` made
  every later ``/metrics`` a 500);
* the tier data path refuses a header nested 300,000 levels deep, sent before any token, with
  one clean error and a closed connection, logs no traceback, and keeps serving (before, the
  JSON parser's ``RecursionError`` killed the connection's thread with a traceback).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import uuid
from pathlib import Path

import httpx
import pytest

from ckptd.tierwire import REPLY, REQUEST, recv_frame, send_frame
from tests.server.daemon import Daemon

pytestmark = pytest.mark.timeout(300)

TOKEN = "hostile-numbers-token-0123"
# Numbers Python's JSON encoder will not write, spliced into a body in place of these strings.
RAW = {"@huge": "1" + "0" * 400, "@1e400": "1e400", "@nan": "NaN", "@inf": "Infinity"}
HUGE = RAW["@huge"]  # 10^400: Python's parser makes it an int


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(daemon, an operator's client on its Unix socket, the job root, the socket's path)."""
    tmp = tmp_path_factory.mktemp("hostile")
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    root = tmp / "job"
    root.mkdir()
    sock = Path("/tmp") / f"ckptd-hostile-{uuid.uuid4().hex[:8]}.sock"  # short: sun_path is 108 bytes
    d = Daemon([str(root)], tmp / "staging", tmp / "daemon.log", token_file=token, trust_tcp=False)
    d.env["CKPTD_SOCKET"] = str(sock)
    with d:
        client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)),
            base_url="http://ckptd",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        try:
            yield d, client, str(root), sock
        finally:
            client.close()


def _json(body: dict) -> dict:
    text = json.dumps(body)
    for name, raw in RAW.items():
        text = text.replace(f'"{name}"', raw)
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


def _hostile(root: str, lease: str) -> list[tuple[str, str, dict]]:
    r, top = root, 2**63
    job = {"lease": lease, "root": r, "step": 1, "attempt": "a", "rank": 0, "world_size": 1, "shards": []}
    replica = {"root": r, "step": 1, "attempt": "a", "source": "s", "objects": []}
    obj = {"key": "k", "size": "@huge", "crc32c": 0}
    tier = {"root": r, "step": 1, "attempt": "a"}
    return [
        ("POST", "/v1/tiers/restored", _json({"local": "@huge"})),
        ("POST", "/v1/tiers/restored", _json({"peer": top})),
        ("POST", "/v1/tiers/restored", _json({"root": "@1e400"})),
        ("POST", "/v1/tiers/restored", _json({"local": -1})),
        ("POST", "/v1/leases", _json({"root": r, "rank": "@huge", "bytes": 1, "client": "x"})),
        ("POST", "/v1/leases", _json({"root": r, "rank": 0, "bytes": "@huge", "client": "x"})),
        ("POST", "/v1/leases", _json({"root": r, "rank": 0, "bytes": 1, "want": top, "client": "x"})),
        ("POST", f"/v1/leases/{lease}/grow", _json({"bytes": "@huge"})),
        ("POST", "/v1/jobs", _json(job | {"world_size": "@huge"})),
        ("POST", "/v1/jobs", _json(job | {"rank": top})),
        ("POST", "/v1/jobs", _json(job | {"commit_timeout": "@1e400"})),
        ("POST", "/v1/jobs", _json(job | {"commit_timeout": "@nan"})),
        ("POST", "/v1/jobs", _json(job | {"done": {"n": "@huge"}})),
        ("POST", "/v1/jobs", _json(job | {"done": {"n": ["@inf"]}})),
        ("POST", "/v1/tiers/replicas", _json(replica | {"objects": [obj]})),
        ("POST", "/v1/tiers/replicas", _json(replica | {"ranks": ["@huge"]})),
        ("PUT", f"/v1/tiers/replicas/x?key=k&offset={HUGE}", {"content": b"x"}),
        ("POST", "/v1/tiers/read", _json(tier | {"ranges": [{"key": "k", "start": "@huge", "length": 1}]})),
        ("GET", f"/v1/tiers/object?root={r}&step=1&attempt=a&key=k&start={HUGE}&length=1", {}),
        ("GET", f"/v1/checkpoints/{HUGE}?root={r}", {}),
        ("GET", f"/v1/job-roots?root={r}&offset={HUGE}", {}),
        ("GET", f"/v1/overview?offset={HUGE}", {}),
        ("GET", f"/v1/page?offset={HUGE}", {}),
        ("POST", f"/v1/page/verify?root={r}&step={HUGE}", {"headers": {"X-Ckptd-Page": "1"}}),
        ("POST", "/v1/tiers/reserve", _json(tier | {"rank": 0, "bytes": "@huge"})),
        ("POST", "/v1/tiers/restored", {"content": b"[" * 300_000, "headers": {"Content-Type": "application/json"}}),
    ]


def _answering(d: Daemon, client: httpx.Client) -> None:
    for path in ("/metrics", "/v1/overview", "/v1/page", "/", "/v1/tiers", "/v1/status"):
        got = client.get(path)
        assert got.status_code == 200, (path, got.status_code, got.text[:500], d.logs())


def test_numbers_in_every_request_are_bounded(served):
    d, client, root, _ = served
    _answering(d, client)
    lease = client.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 0, "client": "t"})
    assert lease.status_code == 200, lease.text
    lease_id = lease.json()["lease"]
    accepted = []
    for method, path, kw in _hostile(root, lease_id):
        got = client.request(method, path, **kw)
        if not 400 <= got.status_code < 500:
            accepted.append((method, path[:80], got.status_code, got.text[:200]))
        _answering(d, client)
    assert not accepted, accepted
    assert "Traceback" not in d.log_path.read_text(), d.logs()


def _frame(payload: bytes) -> bytes:
    return struct.pack(">4sI", REQUEST, len(payload)) + payload


def test_a_deep_frame_before_auth_is_refused_cleanly(served):
    d, client, root, sock = served
    data = client.get("/v1/tiers").json()["data"]
    assert data and data["port"] > 0, data
    addrs = [(socket.AF_INET, ("127.0.0.1", data["port"])), (socket.AF_UNIX, data["socket"])]
    for family, addr in addrs:
        for deep in (b"[" * 300_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                s.connect(addr)
                s.sendall(_frame(deep))
                got = recv_frame(s, REPLY)
                assert got is not None, "the connection closed without a reply"
                assert got[0]["ok"] is False and got[0]["status"] == 400, got
                assert "deep" in got[0]["detail"], got
                assert s.recv(1) == b""  # closed after the one reply
        # and it keeps serving: a well-formed request (with the token) gets its answer, and a
        # range with a hostile number gets a 400
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(addr)
            ask = {"token": TOKEN, "op": "read", "root": root, "step": 1, "attempt": "a"}
            send_frame(s, REQUEST, {**ask, "ranges": [["k", 0, 1]]})
            got = recv_frame(s, REPLY)
            assert got is not None and got[0]["status"] == 404, got
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(addr)
            send_frame(s, REQUEST, {**ask, "ranges": [["k", 10**400, 1]]})
            got = recv_frame(s, REPLY)
            assert got is not None and got[0]["status"] == 400, got
    log = d.log_path.read_text()
    assert "Traceback" not in log and "RecursionError" not in log, d.logs()
    _answering(d, client)


# Every numeric field of every route, each given each of these (-1 is legal for a range's start:
# from the end, which then answers 404 for a key not held: still one clear 4xx).
BAD_BODY = ("@huge", -1, "@nan", 2**64)
BAD_QUERY = (HUGE, "-1", "nan", str(2**64))


def _fields(root: str, lease: str) -> list[tuple[str, str, dict, str]]:
    """(method, path, a valid body, the field to spoil: ``a.0.b`` for ``body["a"][0]["b"]``)."""
    r = root
    tier = {"root": r, "step": 1, "attempt": "a"}
    job = {"lease": lease, "root": r, "step": 1, "attempt": "a", "rank": 0, "world_size": 1, "shards": []}
    replica = tier | {"ranks": [0], "objects": [{"key": "step_00000001/arrays/k", "size": 1, "crc32c": 0}]}
    out = [("POST", "/v1/tiers/restored", {"job_root": r, "restored_step": 1}, f) for f in ("local", "peer", "root")]
    out += [("POST", "/v1/tiers/restored", {"job_root": r, "restored_step": 1}, "restored_step")]
    out += [
        ("POST", "/v1/leases", {"root": r, "rank": 0, "bytes": 1, "client": "x"}, f) for f in ("rank", "bytes", "want")
    ]
    out += [("POST", f"/v1/leases/{lease}/grow", {"bytes": 0}, f) for f in ("bytes", "want")]
    out += [("POST", "/v1/jobs", job, f) for f in ("step", "rank", "world_size", "commit_timeout")]
    out += [
        ("POST", "/v1/tiers/reserve", tier | {"rank": 0, "bytes": 0}, f) for f in ("step", "rank", "bytes", "objects")
    ]
    ranges = tier | {"ranges": [{"key": "k", "start": 0, "length": 1}]}
    out += [("POST", "/v1/tiers/read", ranges, f) for f in ("step", "ranges.0.start", "ranges.0.length")]
    out += [
        ("POST", "/v1/tiers/replicas", replica, f) for f in ("step", "ranks.0", "objects.0.size", "objects.0.crc32c")
    ]
    return out


def _queries(root: str) -> list[tuple[str, str]]:
    """(method, path with ``{v}`` where the number goes)."""
    r = root
    obj = f"/v1/tiers/object?root={r}&attempt=a&key=k"
    return [
        ("GET", f"/v1/tiers?root={r}&step={{v}}"),
        ("GET", f"{obj}&step={{v}}&start=0&length=1"),
        ("GET", f"{obj}&step=1&start={{v}}&length=1"),
        ("GET", f"{obj}&step=1&start=0&length={{v}}"),
        ("GET", f"/v1/checkpoints/{{v}}?root={r}"),
        ("GET", f"/v1/job-roots?root={r}&offset={{v}}"),
        ("GET", f"/v1/job-roots?root={r}&limit={{v}}"),
        ("GET", "/v1/overview?offset={v}"),
        ("GET", "/v1/overview?limit={v}"),
        ("GET", "/v1/page?offset={v}"),
        ("GET", "/v1/page?limit={v}"),
        ("POST", f"/v1/page/verify?root={r}&step={{v}}"),
        ("GET", "/v1/jobs?limit={v}"),
        ("GET", "/v1/jobs/0123456789abcdef?wait={v}"),
        ("PUT", "/v1/tiers/replicas/x?key=k&offset={v}"),
    ]


def _spoil(body: dict, field: str, value) -> dict:
    body = json.loads(json.dumps(body))
    *path, last = field.split(".")
    at = body
    for p in path:
        at = at[int(p)] if p.isdigit() else at[p]
    at[int(last) if last.isdigit() else last] = value
    return body


def test_every_numeric_field_refuses_huge_negative_nan_and_2_64(served):
    d, client, root, sock = served
    lease = client.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 0, "client": "m"})
    assert lease.status_code == 200, lease.text
    accepted = []
    for method, path, body, field in _fields(root, lease.json()["lease"]):
        for bad in BAD_BODY:
            got = client.request(method, path, **_json(_spoil(body, field, bad)))
            if not 400 <= got.status_code < 500:
                accepted.append((method, path, field, bad, got.status_code, got.text[:200]))
    for method, path in _queries(root):
        for bad in BAD_QUERY:
            headers = {"X-Ckptd-Page": "1"} if "verify" in path else {}
            got = client.request(method, path.format(v=bad), headers=headers, content=b"x" if method == "PUT" else None)
            if not 400 <= got.status_code < 500:
                accepted.append((method, path, bad[:20], got.status_code, got.text[:200]))
    data = client.get("/v1/tiers").json()["data"]
    ask = {"token": TOKEN, "op": "read", "root": root, "step": 1, "attempt": "a", "ranges": [["k", 0, 1]]}
    for bad in (10**400, -1, float("nan"), 2**64):
        for spoiled in ({**ask, "step": bad}, {**ask, "ranges": [["k", bad, 1]]}, {**ask, "ranges": [["k", 0, bad]]}):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                s.connect(data["socket"])
                send_frame(s, REQUEST, spoiled)
                got = recv_frame(s, REPLY)
                if got is None or not 400 <= got[0]["status"] < 500:
                    accepted.append(("data path", str(bad)[:20], got))
    assert not accepted, accepted
    _answering(d, client)
    assert "Traceback" not in d.log_path.read_text(), d.logs()
