"""``Tenancy`` with the bindings replicas carry (``carried``) and the readers' tickets (``vouch``):
the rules alone, without daemons (tests/security/test_tier_trust.py runs them with real users),
and one real daemon that two peers push replicas of one root to at once, carrying other uids."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import quote

import pytest

from ckptd import manifest as mf
from ckptd.daemon_conn import PEER_HEADER, peer_auth
from ckptd.server import tenancy as tn
from ckptd.server.replication import MAX_OBJECTS
from ckptd.server.tenancy import Caller, Forbidden, Peer, Tenancy
from tests import load
from tests.distributed import launch
from tests.server.daemon import PEER_KEY, node

ALICE, BOB = 60001, 60002


def _tenancy(tmp_path, binds=None) -> Tenancy:
    t = Tenancy(tmp_path, trust_tcp=False, binds=binds)
    t.peer_key = b"k" * 32
    return t


def _on_socket(uid: int) -> Caller:
    return Caller(Peer(1, uid, uid), False)


def test_a_carried_binding_decides_reads_and_writes_in_memory_only(tmp_path):
    t = _tenancy(tmp_path)
    root = str(tmp_path / "jobs" / "alice")
    t.carried = lambda: [(root, ALICE, "http://a:1")]
    t.check_read(_on_socket(ALICE), root)
    for caller in (_on_socket(BOB), Caller(None, False)):
        with pytest.raises(Forbidden, match="a replica from http://a:1"):
            t.check_read(caller, root + "/sub")
        with pytest.raises(Forbidden):
            t.check_write(caller, root, bind=False)
    assert t.visible(_on_socket(BOB), [{"root": root}]) == []
    assert t.bound_uid(root) == ALICE
    assert not (tmp_path / tn.BINDINGS_FILE).exists()  # nothing written for it
    t.carried = lambda: []  # the replica is gone: so is the binding it carried
    assert t.bound_uid(root) is None


def test_a_conflicting_carried_binding_is_refused(tmp_path, caplog):
    root = str(tmp_path / "jobs" / "alice")
    t = _tenancy(tmp_path, binds=[f"{tmp_path / 'jobs'}={BOB}"])
    begun = []
    with pytest.raises(Forbidden, match="replica refused"):
        t.carry(root, ALICE, "http://a:1", lambda: begun.append(ALICE))
    assert "replica refused" in caplog.text and begun == []  # refused before it is begun
    assert t.carry(root, BOB, "http://a:1", lambda: "rid") == "rid"  # agreeing: accepted
    t = _tenancy(tmp_path)
    t.carried = lambda: [(root, ALICE, "http://a:1")]
    with pytest.raises(Forbidden):  # another peer's replica of it names another uid
        t.carry(root, BOB, "http://c:1", lambda: begun.append(BOB))
    assert begun == []


def test_a_ticket_names_its_reader_for_reads_only(tmp_path, monkeypatch):
    t = _tenancy(tmp_path)
    root = str(tmp_path / "jobs" / "alice")
    t.carried = lambda: [(root, ALICE, "http://a:1")]
    ticket = t.vouch(_on_socket(ALICE), root)
    with pytest.raises(Forbidden):  # only a caller the kernel named gets one
        t.vouch(Caller(None, False), root)
    with pytest.raises(Forbidden):  # for a root it may read here
        t.vouch(_on_socket(BOB), root)
    scope = {"headers": [(b"x-ckptd-vouch", ticket.encode())]}
    reader = t.caller(scope)
    assert reader.vouched and reader.uid == ALICE and not reader.operator
    t.check_read(reader, root)
    with pytest.raises(Forbidden):
        t.check_write(reader, root, bind=False)
    assert not t.owns(reader, ALICE)
    other = str(tmp_path / "jobs" / "alice2")  # unbound: any caller reads it, but not with this ticket
    t.check_read(Caller(None, False), other)
    with pytest.raises(Forbidden, match="ticket for another root"):
        t.check_read(reader, other)
    assert t.visible(reader, [{"root": root}, {"root": other}]) == [{"root": root}]
    forged = f"{BOB} {ticket.split(' ', 1)[1]}"
    other_key = _tenancy(tmp_path / "other")
    other_key.peer_key = b"o" * 32
    moved = ticket.replace(quote(root, safe=""), quote(other, safe=""))  # renamed to another root
    assert moved != ticket
    for bad in (forged, moved, other_key.vouch(_on_socket(ALICE), root), "junk", ""):
        c = t.caller({"headers": [(b"x-ckptd-vouch", bad.encode())]})
        assert c.peer is None and not c.vouched, bad
    monkeypatch.setattr(time, "time", lambda: 10**10)  # expired
    assert t.caller(scope).peer is None


def _push(url: str, token: str, sender: str, body: dict) -> int:
    """``body`` POSTed to the replica route of ``url``, signed as the peer daemon ``sender``."""
    path, raw = "/v1/tiers/replicas", json.dumps(body).encode()
    req = urllib.request.Request(url + path, raw, {"Content-Type": "application/json"})
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header(PEER_HEADER, peer_auth(PEER_KEY.encode(), sender, "POST", path, raw))
    try:
        with urllib.request.urlopen(req, timeout=load.scaled(60)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_two_replicas_of_one_root_carrying_other_uids_at_once_one_is_kept(tmp_path):
    """Two peers push a replica of one root at once, one bound there to alice, one to bob: the
    root is decided once, for the first; the other is refused (403), never both kept. Each
    replica names many (empty) objects, so the daemon takes a while to begin it: before, both
    were checked against the replicas already held, neither of which was the other, and both kept."""
    token = "carried-race-token-0123456789"
    (tmp_path / "token").write_text(token)
    os.chmod(tmp_path / "token", 0o600)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    # Share 1: each replica names more objects than half the tier holds (``--tenant-share``).
    d = node(tmp_path, "b", f"file://{jobs}", port, [url], trust_tcp=False, CKPTD_TENANT_SHARE="1")
    try:
        keys = [f"{mf.step_dir(3)}/o{i:05d}" for i in range(MAX_OBJECTS)]
        objects = [{"key": k, "size": 0, "crc32c": 0} for k in keys]
        for n in range(3):  # each try a root of its own
            root = f"file://{jobs}/job{n}"
            part = {"root": root, "step": 3, "attempt": "x", "kind": "memory_only", "ranks": [0], "objects": objects}
            got: dict[int, int] = {}
            start = threading.Barrier(2)

            def push(uid: int, sender: str, part=part, got=got, start=start) -> None:
                start.wait()
                got[uid] = _push(url, token, sender, part | {"uid": uid})

            threads = [threading.Thread(target=push, args=(uid, f"http://127.0.0.1:{9 + uid}")) for uid in (ALICE, BOB)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(got.values()) == [200, 403], (n, got, d.logs())
            assert d.logs().count("memory tier: replica refused: ") == n + 1, d.logs()  # once per refusal
            status, listed = d.get(f"/v1/tiers?root={root}", token, tcp=True)
            assert status == 403, listed  # bound here (to the one kept): a TCP caller does not read it
    finally:
        d.kill()
