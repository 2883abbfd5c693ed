"""Peer discovery for the memory tier (``ckptd serve --discover``, ``ckptd.server.discovery``),
with real daemons on loopback as nodes and the job root on a local folder.

- The ring comes from the ``_daemons/`` records: a 4-rank job over 3 daemons replicates every
  hot copy to the next daemon of the sorted ring; after a SIGKILL of one, a 3-rank restore reads
  no byte from the job root (the discovered peers are named to the ranks); the dead daemon's
  record goes stale, drops out of the ring, and the next step's replicas go to the re-formed
  ring.
- A forged record pointing at a local HTTP server that logs every request (and relays the
  challenge to a real daemon, the strongest thing it can do without the token) never sees the
  token nor a replica byte; the replicas go to the real peer.
- Records that are oversized, not JSON, off-schema, with a non-http(s) URL or a bad name are
  ignored with one log line each; the daemon keeps running.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ckptd.server.discovery import hello_mac
from ckptd.server.tiers import replica_targets
from tests.distributed import launch
from tests.server.daemon import Daemon, peer_key_file, wait_for

pytestmark = pytest.mark.timeout(900)

SCENARIOS = "tests.server.tier_scenarios"
TOKEN = "discovery-test-token-0123456789"


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _token(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text(TOKEN)
    os.chmod(path, 0o600)
    return path


def _daemon(tmp: Path, name: str, root: str, ttl: float = 10.0, **env: str) -> Daemon:
    port = launch.free_port()
    d = Daemon(
        [root],
        tmp / f"staging-{name}",
        tmp / f"{name}.log",
        token_file=tmp / "token",
        CKPTD_DISCOVER="true",
        CKPTD_ADVERTISE=_url(port),
        CKPTD_DISCOVER_INTERVAL_S="0.5",
        CKPTD_DISCOVER_TTL_S=str(ttl),
        **({"CKPTD_PEER_KEY_FILE": str(peer_key_file(tmp))} | env),
    )
    return d.start(port=port)


def _pushed(d: Daemon, step: int) -> dict:
    """``replicated_to`` of the daemon's one hot copy, which must be of ``step``."""
    (hot,) = _tiers(d)["hot"]
    assert hot["step"] == step, hot
    return hot["replicated_to"]


def _tiers(d: Daemon) -> dict:
    status, body = d.get("/v1/tiers", TOKEN)
    assert status == 200, body
    return body  # type: ignore[return-value]


def _ring(d: Daemon, root: str) -> list[str]:
    return _tiers(d).get("discovery", {}).get("rings", {}).get(root, [])


def _replicas(d: Daemon, step: int) -> set[str]:
    """The sources of the complete replicas of ``step`` that ``d`` holds."""
    return {r["source"] for r in _tiers(d)["replicas"] if r["step"] == step and r["complete"]}


def _save(world: int, daemons: list[Daemon], root: str, out: Path, step: int) -> None:
    procs = launch.spawn(
        world,
        "save_steps",
        {"daemons": [d.socket_url for d in daemons], "root": root, "steps": [step]},
        out,
        {"CKPTD_TOKEN": TOKEN},
        scenarios=SCENARIOS,
    )
    launch.wait(procs, out, "save_steps", timeout=600)


def _advertised(path: Path) -> str | None:
    """The URL a record file names, None when it is no record."""
    try:
        return json.loads(path.read_bytes()[:4096])["advertise"]
    except (ValueError, KeyError, TypeError, OSError, RecursionError):
        return None


def _log(d: Daemon) -> str:
    return d.log_path.read_text(errors="replace")


def _record(url: str, daemon_id: str | None = None) -> tuple[str, bytes]:
    daemon_id = daemon_id or secrets.token_hex(16)
    rec = {"format": 1, "daemon": daemon_id, "advertise": url, "heartbeat": int(time.time() * 1000), "version": "x"}
    return f"{daemon_id}.json", json.dumps(rec).encode()


def test_replicas_follow_the_discovered_ring_and_it_reforms_after_a_node_dies(tmp_path):
    _token(tmp_path)
    job = tmp_path / "job"
    root = f"file://{job}"
    nodes = [_daemon(tmp_path, n, root) for n in ("a", "b", "c")]
    try:
        ring = sorted(d.url for d in nodes)
        wait_for(lambda: all(_ring(d, root) == ring for d in nodes), "every daemon seeing the 3 records", 60)

        # A 4-rank job over the 3 node daemons (ranks 0-1, 2, 3): each hot copy lands on the
        # next daemon of the sorted ring, and only there.
        _save(4, nodes, root, tmp_path / "s1", step=1)
        by_url = {d.url: d for d in nodes}
        want = {d.url: replica_targets(ring, d.url, 1)[0] for d in nodes}
        holders = {u: {src for src, t in want.items() if t == u} for u in ring}
        wait_for(lambda: all(_replicas(by_url[u], 1) == holders[u] for u in ring), "the ring's replicas", 120)
        # The sender marks its push complete once the receiver's seal answered: after the
        # receiver lists it, so it is waited for too.
        wait_for(lambda: all(_pushed(d, 1) == {want[d.url]: "complete"} for d in nodes), "the pushes complete", 60)

        # A node dies: SIGKILL, its record is left behind and goes stale; the others' rings drop it.
        dead = by_url[ring[1]]
        dead.kill()
        (record,) = [p for p in (job / "_daemons").iterdir() if _advertised(p) == dead.url]
        alive = [d for d in nodes if d is not dead]
        new_ring = sorted(d.url for d in alive)

        # The job restarts at 3 ranks on a survivor: its daemon names the discovered peers, and
        # every byte of step 1 comes from the survivors' memory (the dead node's hot copy from
        # its successor's replica), none from the job root.
        procs = launch.spawn(
            3,
            "restore_tiered",
            {"daemon": alive[0].socket_url, "root": root, "ref": str(tmp_path / "s1" / "ref_step1.pt")},
            tmp_path / "r3",
            {"CKPTD_TOKEN": TOKEN},
            scenarios=SCENARIOS,
        )
        res = launch.wait(procs, tmp_path / "r3", "restore_tiered", timeout=600)
        assert all(r["step"] == 1 for r in res) and res[0]["mismatches"] == [], res
        got = {k: sum(r["tiers"][k] for r in res) for k in ("local", "peer", "root")}
        assert got["root"] == 0 and got["peer"] > 0, got
        wait_for(lambda: all(_ring(d, root) == new_ring for d in alive), "the dead node's record going stale", 120)
        assert record.exists()  # nobody deleted it: it only went stale

        # The next step: each survivor replicates to its successor in the re-formed ring.
        _save(2, alive, root, tmp_path / "s2", step=2)
        want2 = {d.url: replica_targets(new_ring, d.url, 1)[0] for d in alive}
        wait_for(
            lambda: all(_replicas(by_url[t], 2) == {s} for s, t in want2.items()), "replicas of the re-formed ring", 120
        )
        wait_for(lambda: all(_pushed(d, 2) == {want2[d.url]: "complete"} for d in alive), "the pushes complete", 60)

        # A clean shutdown removes the daemon's record.
        alive[0].stop()
        left = [_advertised(p) for p in (job / "_daemons").iterdir()]
        assert alive[0].url not in left and alive[1].url in left
    finally:
        for d in nodes:
            d.kill()


class _LoggingRelay:
    """An HTTP server that logs every request (method, path, headers, body size) and answers
    200 to all; the discovery challenge it relays to a real daemon and answers with that
    daemon's reply: a forged record's best attempt without the token. With ``token`` it answers
    the challenge itself, keyed by that token: a trainer's server (trainers hold the token)."""

    def __init__(self, upstream: str, token: str | None = None):
        up = urlsplit(upstream)
        self.requests: list[dict] = []
        self.relayed: list[int] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _log(self, body: bytes) -> None:
                outer.requests.append(
                    {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": len(body)}
                )

            def _reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's name
                self._log(b"")
                if self.path.startswith("/v1/tiers/hello") and token is not None:
                    nonce = bytes.fromhex(self.path.split("nonce=")[1])
                    return self._reply(200, json.dumps({"mac": hello_mac(token, nonce, outer.url)}).encode())
                if self.path.startswith("/v1/tiers/hello"):
                    conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                    conn.request("GET", self.path)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                    outer.relayed.append(resp.status)
                    return self._reply(resp.status, data)
                self._reply(200, b"{}")

            def _write(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._log(body)
                self._reply(200, json.dumps({"replica": "r1"}).encode())

            do_POST = do_PUT = _write  # noqa: N815

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_forged_record_never_gets_the_token_nor_replica_bytes(tmp_path):
    _token(tmp_path)
    job = tmp_path / "job"
    root = f"file://{job}"
    a = _daemon(tmp_path, "a", root, ttl=120.0, CKPTD_REPLICAS="2")
    b = _daemon(tmp_path, "b", root, ttl=120.0, CKPTD_REPLICAS="2")
    relay = _LoggingRelay(b.url)
    try:
        # Anyone who can write the job root plants a record naming their server.
        name, data = _record(relay.url)
        (job / "_daemons" / name).write_bytes(data)
        ring = sorted([a.url, b.url, relay.url])
        wait_for(lambda: _ring(a, root) == ring and _ring(b, root) == ring, "the forged record in the rings", 60)

        # k=2: each daemon tries both other ring members; the relay is dialled, challenged, and
        # refused (it can only relay b's answer, which binds b's URL, not its own).
        _save(2, [a, b], root, tmp_path / "s1", step=1)
        wait_for(lambda: _replicas(a, 1) == {b.url} and _replicas(b, 1) == {a.url}, "the real replicas", 120)
        for d, other in ((a, b), (b, a)):
            (hot,) = _tiers(d)["hot"]
            assert hot["replicated_to"] == {other.url: "complete"}, hot
        assert relay.requests and all(r["path"].startswith("/v1/tiers/hello?") for r in relay.requests), relay.requests
        assert 200 in relay.relayed  # b did answer the relayed challenge: the answer was refused anyway
        for r in relay.requests:
            assert not any(h.lower() == "authorization" for h in r["headers"]), r
            assert TOKEN not in json.dumps(r), r
            assert r["method"] == "GET" and r["body"] == 0, r
        # Nor is it named to restoring ranks, which would send it their token.
        for d in (a, b):
            assert relay.url not in _tiers(d)["peers"]
            status, body = d.get(f"/v1/tiers?root={root}&step=1&attempt=x&keys=true", TOKEN)
            assert status == 200 and relay.url not in body["peers"], body
        assert "wrong challenge answer" in _log(a)
    finally:
        relay.close()
        a.kill()
        b.kill()


def test_a_trainers_server_with_the_token_does_not_pass_the_challenge(tmp_path):
    """The challenge is keyed by the daemons' peer key: a trainer, who holds the token, plants a
    record naming its own server, which answers the challenge with the token. It is refused:
    no replica request (which would carry the weights), not named to restoring ranks."""
    _token(tmp_path)
    job = tmp_path / "job"
    root = f"file://{job}"
    a = _daemon(tmp_path, "a", root, ttl=120.0)
    fake = _LoggingRelay(a.url, token=TOKEN)
    try:
        name, data = _record(fake.url)
        (job / "_daemons").mkdir(parents=True, exist_ok=True)
        (job / "_daemons" / name).write_bytes(data)
        wait_for(lambda: _ring(a, root) == sorted([a.url, fake.url]), "the trainer's record in the ring", 60)
        _save(1, [a], root, tmp_path / "s1", step=1)
        wait_for(lambda: "wrong challenge answer" in _log(a), "the refused challenge", 60)
        (hot,) = _tiers(a)["hot"]
        assert hot["replicated_to"] == {}, hot
        assert fake.requests and all(r["path"].startswith("/v1/tiers/hello?") for r in fake.requests), fake.requests
        assert fake.url not in _tiers(a)["peers"]
    finally:
        fake.close()
        a.kill()


def test_hostile_records_are_ignored_with_one_log_line_each(tmp_path):
    _token(tmp_path)
    job = tmp_path / "job"
    folder = job / "_daemons"
    folder.mkdir(parents=True)
    root = f"file://{job}"
    hexid = secrets.token_hex
    name, good = _record("http://127.0.0.1:9")
    bad = {
        name: good[:-1] + b" " * (64 << 10) + b"}",  # a valid record padded past the size cap
        "evil.json": good,  # not <32 hex digits>.json
    }
    for data in (
        b"\xff\xfe not json",
        b"[" * 2000,  # under the cap, an unclosed nest: not JSON
        json.dumps({**json.loads(good), "extra": 1}).encode(),
        b'{"format": 1, "daemon": "x", "advertise": "http://h:1", "heartbeat": 1, "version": ""}',
        json.dumps(["a list"]).encode(),
    ):
        bad[f"{hexid(16)}.json"] = data
    for url in ("file:///etc/passwd", "javascript:alert(1)", "http://user:pw@127.0.0.1:1", "http://h:1/?q#f"):
        n, data = _record(url)
        bad[n] = data
    for n, data in bad.items():
        (folder / n).write_bytes(data)
    (folder / "sub").mkdir()
    (folder / "sub" / f"{hexid(16)}.json").write_bytes(good)
    bad["sub/"] = b""
    d = _daemon(tmp_path, "a", root, ttl=120.0)
    try:
        wait_for(lambda: all(n in _log(d) for n in bad), "a log line for every hostile record", 60)

        # A few more refreshes: the daemon renews its record (its heartbeat changes) each time.
        (own,) = [p for p in folder.iterdir() if p.is_file() and _advertised(p) == d.url]
        beats = set()
        wait_for(lambda: beats.add(json.loads(own.read_text())["heartbeat"]) or len(beats) >= 4, "4 renewals", 60)

        lines = [line for line in _log(d).splitlines() if "ignoring daemon record" in line]
        for n in bad:
            assert sum(n in line for line in lines) == 1, (n, lines)
        assert len(lines) == len(bad), lines
        assert "Traceback" not in _log(d)
        assert d.healthy() and _ring(d, root) == [d.url]
        assert _tiers(d)["peers"] == [d.url]
        assert re.search(r"is over 2048", _log(d))
    finally:
        d.kill()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"CKPTD_PEERS": '["http://127.0.0.1:1"]'}, "--discover and --peers exclude each other"),
        ({"CKPTD_ADVERTISE": ""}, "--discover needs --advertise"),
    ],
)
def test_discover_refuses_settings_it_cannot_keep(tmp_path, extra, message):
    import subprocess
    import sys

    _token(tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": str(launch.ROOT),
        "CKPTD_DISCOVER": "true",
        "CKPTD_ADVERTISE": "http://127.0.0.1:1",
        **extra,
    }
    args = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", f"file://{tmp_path / 'job'}"]
    args += ["--port", str(launch.free_port()), "--staging-dir", str(tmp_path / "st")]
    args += ["--token-file", str(tmp_path / "token")]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
