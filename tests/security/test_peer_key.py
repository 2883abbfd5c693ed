"""Daemons and trainers are two parties: replicas need the peer key, which trainers never hold.

Real daemons on loopback, the documented configuration (token file, default socket, no
--trust-tcp). Every local user can read the trainers' token; only the daemons read the peer key
(``--peer-key-file``, 0600). A trainer that pushes a forged memory-only step into another
user's root with the token is refused (403) whatever address it uses, and the victim's restore
never returns it; a request signed with a wrong key, at a stale time or replayed is refused; the
source of a replica is the signed sender, never a body field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from ckptd.codec import crc32c
from ckptd.daemon_conn import DaemonConnection
from tests import load
from tests.distributed import launch
from tests.security.tenant import push_replica
from tests.server.daemon import PEER_KEY, ROOT, Daemon, node
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "peer-key-test-token-0123456789"
SENDER = "http://127.0.0.1:9"  # the URL a signed request names as its sender
KEY = "step_0000000002/arrays/model/w/c/0"
PEER_HEADER = "X-Ckptd-Peer"  # "<sender URL> <unix time> <nonce> <HMAC-SHA256 hex>"


def _mac(key: str, method: str, target: str, body: bytes, when: str, nonce: str) -> str:
    """What a daemon signs (``ckptd.daemon_conn.peer_mac``), written out here as the wire format."""
    msg = "\n".join([method, target, hashlib.sha256(body).hexdigest(), when, nonce, SENDER])
    return hmac.new(key.encode(), msg.encode(), hashlib.sha256).hexdigest()


def _token(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text(TOKEN)
    os.chmod(path, 0o600)
    return path


def _call(url: str, method: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=body, method=method)
    req.add_header("Authorization", f"Bearer {TOKEN}")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _signed(method: str, path: str, body: bytes, key: str = PEER_KEY, age: int = 0) -> dict:
    when, nonce = str(int(time.time()) - age), os.urandom(16).hex()
    return {PEER_HEADER: f"{SENDER} {when} {nonce} {_mac(key, method, path, body, when, nonce)}"}


def test_a_trainer_with_the_token_cannot_push_a_forged_memory_only_step(tmp_path, monkeypatch):
    """Bob, who holds the trainers' token, saves a memory-only step 11 of his own (666.0) and
    pushes its bytes as a replica into Alice's root, over TCP and over the Unix socket, claiming
    ``source`` "self": 403 each time, and Alice's next restore returns her own step 1."""
    _token(tmp_path)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(tmp_path / "token"))
    jobs = tmp_path / "jobs"
    port = launch.free_port()
    d = node(tmp_path, "a", f"file://{jobs}", port, [f"http://127.0.0.1:{port}"], trust_tcp=False)
    alice, bob = f"file://{jobs / 'alice'}", f"file://{jobs / 'bob'}"
    sock = DaemonConnection(d.socket_url, TOKEN)
    tcp = DaemonConnection(d.url, TOKEN)
    try:
        with Checkpointer(alice, daemon=d.socket_url) as ck:
            ck.save(1, {"w": torch.ones(1024)}).result()
        with Checkpointer(bob, daemon=d.socket_url, persist_every=100) as ck:
            ck.save(11, {"w": torch.full((1024,), 666.0)}).result()
        status, _, raw = sock.fetch("GET", f"/v1/tiers?root={urllib.parse.quote(bob)}&keys=true")
        assert status == 200, raw
        (part,) = json.loads(raw)["memory_only"]
        objects = {}
        for key, size in part["keys"].items():
            q = urllib.parse.urlencode({"root": bob, "step": 11, "attempt": part["attempt"], "key": key})
            status, _, data = sock.fetch("GET", f"/v1/tiers/object?{q}&start=0&length={size}")
            assert status == 200 and len(data) == size, data[:200]
            objects[key] = data
        forged = {"root": alice, "step": 11, "attempt": part["attempt"], "kind": "memory_only", "ranks": [0]}
        forged |= {
            "source": "self",
            "objects": [{"key": k, "size": len(v), "crc32c": crc32c(v)} for k, v in objects.items()],
        }
        for conn in (tcp, sock):
            got = push_replica(conn, forged, objects)
            assert got == [403], got
        status, _, raw = sock.fetch("GET", f"/v1/tiers?root={urllib.parse.quote(alice)}")
        assert json.loads(raw)["memory_only"] == [], raw
        state = {"w": torch.zeros(1024)}
        with Checkpointer(alice, daemon=d.socket_url) as ck:
            assert ck.restore(state) == 1
        assert torch.equal(state["w"], torch.ones(1024))
    finally:
        sock.close()
        tcp.close()
        d.kill()


def test_wrong_stale_or_replayed_peer_signatures_are_refused(tmp_path):
    """Only a request signed now with the ring's peer key is taken, once; its replica's source is
    the signed sender. A daemon with peers but no peer key says so and takes no replica."""
    _token(tmp_path)
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    d = node(tmp_path, "a", root, port, [f"http://127.0.0.1:{port}", SENDER])
    try:
        data = b"12345678"
        body = {"root": root, "step": 2, "attempt": "att1", "ranks": [0], "source": "self"}
        raw = json.dumps(body | {"objects": [{"key": KEY, "size": 8, "crc32c": crc32c(data)}]}).encode()
        path = "/v1/tiers/replicas"
        status, reply = _call(d.url, "POST", path, raw)  # the token alone
        assert status == 403 and b"peer key" in reply, reply
        status, reply = _call(d.url, "POST", path, raw, _signed("POST", path, raw, key="x" * 64))
        assert status == 403 and b"wrong peer signature" in reply, reply
        status, reply = _call(d.url, "POST", path, raw, _signed("POST", "/v1/tiers/other", raw))
        assert status == 403, reply  # signed for another path
        status, reply = _call(d.url, "POST", path, raw, _signed("POST", path, raw, age=1000))
        assert status == 403 and b"clock" in reply, reply
        good = _signed("POST", path, raw)
        status, reply = _call(d.url, "POST", path, raw, good)
        assert status == 200, reply
        rid = json.loads(reply)["replica"]
        status, reply = _call(d.url, "POST", path, raw, good)  # the same request again
        assert status == 403 and b"replayed" in reply, reply
        piece = f"/v1/tiers/replicas/{rid}?key={urllib.parse.quote(KEY, safe='')}&offset=0"
        assert _call(d.url, "PUT", piece, data)[0] == 403  # every step of the push is signed
        assert _call(d.url, "PUT", piece, data, _signed("PUT", piece, b"87654321"))[0] == 403  # other bytes
        assert _call(d.url, "PUT", piece, data, _signed("PUT", piece, data))[0] == 200
        seal = f"/v1/tiers/replicas/{rid}/seal"
        assert _call(d.url, "POST", seal, b"{}")[0] == 403
        assert _call(d.url, "POST", seal, b"{}", _signed("POST", seal, b"{}"))[0] == 200
        status, tiers = d.get("/v1/tiers", TOKEN)
        assert [r["source"] for r in tiers["replicas"]] == [SENDER], tiers
    finally:
        d.kill()
    keyless = Daemon(
        [root],
        tmp_path / "staging-k",
        tmp_path / "k.log",
        token_file=tmp_path / "token",
        trust_tcp=False,
        CKPTD_PEERS=json.dumps([SENDER]),
        CKPTD_ADVERTISE=f"http://127.0.0.1:{port}",
    )
    with keyless:
        status, reply = _call(keyless.url, "POST", path, raw, _signed("POST", path, raw))
        assert status == 403 and b"no peer key" in reply, reply
        assert "neither pushes replicas to its peers nor accepts theirs" in keyless.logs()


@pytest.mark.parametrize("case", ["group-readable", "short", "not-mine"])
def test_a_peer_key_others_can_read_or_guess_is_refused(tmp_path, case):
    _token(tmp_path)
    key = tmp_path / "peer-key"
    key.write_text("short" if case == "short" else PEER_KEY)
    os.chmod(key, 0o640 if case == "group-readable" else 0o600)
    if case == "not-mine":
        os.chown(key, 65534, 65534)
    args = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", str(tmp_path / "job"), "--port", "0"]
    args += ["--token-file", str(tmp_path / "token"), "--peer-key-file", str(key)]
    args += ["--staging-dir", str(tmp_path / "stg")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTD_SOCKET": str(tmp_path / "s.sock")}
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=load.scaled(60))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "peer key" in p.stderr and "Traceback" not in p.stderr, p.stderr
