"""The memory tier with real daemons on loopback as nodes (each its own staging folder and port,
one token): a 4-rank gloo job, 2 ranks per node, saves through its two node daemons, which keep
hot copies and replicate them to each other. Then one node fails (SIGKILL of its daemon and its
ranks) and the job restores at 3 and at 2 ranks, bitwise, with no chunk byte read from the job
root; then again with a peer that serves a corrupted chunk, with stale replicas, with a peer
slower than the readers' deadline, and with a peer killed during the restore: the chunks come
from the job root, the values stay bitwise equal."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests import load
from tests.distributed import launch
from tests.server.daemon import Daemon, kill_all, node, tier_totals, wait_for

pytestmark = pytest.mark.timeout(900)

SCENARIOS = "tests.server.tier_scenarios"
TOKEN = "tier-test-token-0123456789"


def _run(world: int, scenario: str, out: Path, env: dict | None = None, **args) -> list[dict]:
    procs = launch.spawn(world, scenario, args, out, {"CKPTD_TOKEN": TOKEN, **(env or {})}, scenarios=SCENARIOS)
    return launch.wait(procs, out, scenario, timeout=600)


def _get(d_url: str, path: str, token: str | None = TOKEN) -> tuple[int, object]:
    req = urllib.request.Request(d_url + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _tiers(d: Daemon) -> dict:
    status, body = _get(d.url, "/v1/tiers")
    assert status == 200, body
    return body  # type: ignore[return-value]


def _metric(d: Daemon, name: str) -> float:
    return d.metric(name, TOKEN)


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _check(results: list[dict], step: int) -> dict[str, int]:
    assert all(r["step"] == step for r in results), results
    assert results[0]["mismatches"] == [], results[0]["mismatches"]
    return tier_totals(results)


class _CorruptingPeer:
    """A peer in front of a real daemon that flips one byte of every answer for one shard
    object or batch of them (the first one asked for): the bytes a faulty node would serve."""

    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        state = {"key": None}
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self._proxy("GET", None)

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                self._proxy("POST", self.rfile.read(n))

            def _proxy(self, method: str, body: bytes | None) -> None:
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                headers = {"Authorization": self.headers.get("Authorization", "")}
                if body is not None:
                    headers["Content-Type"] = "application/json"
                conn.request(method, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = bytearray(resp.read())
                if resp.status == 200 and self.path.startswith("/v1/tiers?"):
                    # no data path advertised: the reader comes through this proxy (HTTP)
                    data = bytearray(json.dumps({**json.loads(data), "data": None}).encode())
                if resp.status == 200 and data and self.path.startswith(("/v1/tiers/object", "/v1/tiers/read")):
                    # the first object (or batch of objects) asked for: every answer for it
                    key = [p for p in self.path.split("&") if p.startswith("key=")][0] if body is None else body
                    with lock:
                        state["key"] = state["key"] or key
                        hit = state["key"] == key
                    if hit:
                        data[len(data) // 2] ^= 0xFF
                self.send_response(resp.status)
                for h, v in resp.getheaders():
                    if h.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(h, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.corrupted = state
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_node_failure_restores_from_memory_tiers(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    out = tmp_path / "out"
    pa, pb = launch.free_port(), launch.free_port()
    urls = [_url(pa), _url(pb)]
    a = node(tmp_path, "a", root, pa, urls)
    b = node(tmp_path, "b", root, pb, urls)
    c = None
    procs = []
    try:
        # The job: 4 ranks, ranks 0-1 on node a, 2-3 on node b; steps 1 and 2.
        procs = launch.spawn(
            4,
            "save_steps",
            {"daemons": [a.socket_url, b.socket_url], "root": root, "steps": [1, 2], "hang": True},
            out,
            {"CKPTD_TOKEN": TOKEN},
            scenarios=SCENARIOS,
        )
        wait_for(
            lambda: all((out / f"saved_{r}").exists() for r in range(4)),
            "the saves",
            600,
            procs,
            lambda: launch.logs(out, "save_steps", 4),
        )

        def replicated(d: Daemon, ranks: list[int]) -> bool:
            # Each rank's part is pushed on its own: wait for the peer's last rank, not for the
            # first replica row of step 2 (rank 3's arrives up to a second after rank 2's).
            t = _tiers(d)
            return [h["step"] for h in t["hot"]] == [2] and [(r["step"], r["ranks"]) for r in t["replicas"]] == [
                (2, ranks)
            ]

        wait_for(lambda: replicated(a, [2, 3]) and replicated(b, [0, 1]), "both replicas of step 2", 120, (), a.logs)
        # Item 1: the hot copy is the newest committed step only (step 1's was released).
        hot_a = _tiers(a)["hot"][0]
        assert hot_a["ranks"] == [0, 1] and hot_a["complete"], hot_a
        assert _tiers(a)["replicas"][0]["ranks"] == [2, 3]
        assert _metric(a, "ckptd_tier_hot_bytes") == hot_a["bytes"] > 0
        assert _metric(a, "ckptd_tier_replicas") == 1
        assert _metric(b, "ckptd_tier_replicas_pushed_total") >= 2  # steps 1 and 2

        # Security: the tier routes need the token.
        assert _get(a.url, "/v1/tiers", token=None)[0] == 401
        assert _get(a.url, f"/v1/tiers?root={root}&step=2&attempt=x&keys=true", token="wrong")[0] == 401

        # Node b fails: its daemon and its ranks are SIGKILLed; the job's other ranks go too
        # (the job restarts at a smaller world size).
        b.kill()
        kill_all(procs[2:])
        kill_all(procs[:2])

        # Restore at 3 ranks on node a: every shard from a's memory (its hot copy and b's replica).
        res = _run(3, "restore_tiered", out / "r3", daemon=a.socket_url, root=root, ref=str(out / "ref_step2.pt"))
        got = _check(res, 2)
        assert got["root"] == 0 and got["local"] > 0, got
        assert _metric(a, "ckptd_restore_bytes_root_total") == 0
        assert _metric(a, "ckptd_restore_bytes_local_total") == got["local"]

        # Restore at 2 ranks on a new node c (empty memory; peers a and the dead b): every shard
        # from peer a by ranged reads, b skipped, nothing from the job root.
        pc = launch.free_port()  # every daemon start below on a fresh port: none waits for a port to free
        c = node(tmp_path, "c", root, pc, [urls[0], urls[1], _url(pc)])
        res = _run(2, "restore_tiered", out / "r2", daemon=c.socket_url, root=root, ref=str(out / "ref_step2.pt"))
        got = _check(res, 2)
        assert got["root"] == 0 and got["local"] == 0 and got["peer"] > 0, got
        c.stop()

        # A peer that serves a corrupted chunk: that shard comes from the job root, the others
        # from the peer; the values are the committed ones.
        bad = _CorruptingPeer(a.url)
        try:
            c = node(tmp_path, "c", root, launch.free_port(), [bad.url])
            res = _run(2, "restore_tiered", out / "rbad", daemon=c.socket_url, root=root, ref=str(out / "ref_step2.pt"))
            got = _check(res, 2)
            assert bad.corrupted["key"] is not None
            assert got["root"] > 0 and got["peer"] > 0, got
            c.stop()
        finally:
            bad.close()

        # Stale replicas: a newer step committed that no tier holds (saved straight to the
        # root); a holds step 2 only, so step 3 comes from the job root, bitwise.
        _run(2, "save_direct", out / "s3", root=root, step=3)
        res = _run(
            2, "restore_tiered", out / "rstale", daemon=a.socket_url, root=root, ref=str(out / "s3" / "ref_step3.pt")
        )
        got = _check(res, 3)
        assert got["root"] > 0 and got["local"] == 0 and got["peer"] == 0, got

        # A peer killed during the restore: a's reads are slowed down (test-only fault), it is
        # SIGKILLed once the first read reached it; every shard then comes from the job root.
        # Step 2 in a's memory again: a 2-rank job on node a saves it under a second root.
        root2 = f"file://{tmp_path / 'job2'}"
        a.stop()
        pa, pc = launch.free_port(), launch.free_port()
        a = node(tmp_path, "a", root2, pa, [_url(pa), _url(pc)], tier_delay_s=3)
        _run(2, "save_steps", out / "s2", daemons=[a.socket_url], root=root2, steps=[2])
        c = node(tmp_path, "c", root2, pc, [_url(pa), _url(pc)])
        ref2 = str(out / "s2" / "ref_step2.pt")
        # A peer slower than the readers' deadline: skipped after its first timeout, every shard
        # from the job root.
        res = _run(
            2, "restore_tiered", out / "rslow", {"CKPTD_TIER_TIMEOUT_S": "1"}, daemon=c.socket_url, root=root2, ref=ref2
        )
        got = _check(res, 2)
        assert got["root"] > 0 and got["peer"] == 0, got
        procs = launch.spawn(
            2,
            "restore_tiered",
            {"daemon": c.socket_url, "root": root2, "ref": ref2},
            out / "rkill",
            {"CKPTD_TOKEN": TOKEN},
            scenarios=SCENARIOS,
        )
        before = _metric(a, "ckptd_tier_object_requests_total")
        wait_for(lambda: _metric(a, "ckptd_tier_object_requests_total") > before, "a first tier read", 300, procs)
        a.kill()
        res = launch.wait(procs, out / "rkill", "restore_tiered", timeout=600)
        got = _check(res, 2)
        assert got["root"] > 0, got
    finally:
        kill_all(procs)
        for d in (a, b, c):
            if d is not None:
                d.kill()
