"""``Tenancy`` with the bindings replicas carry (``carried``) and the readers' tickets (``vouch``):
the rules alone, without daemons (tests/security/test_tier_trust.py runs them with real users)."""

from __future__ import annotations

import time

import pytest

from ckptd.server import tenancy as tn
from ckptd.server.tenancy import Caller, Forbidden, Peer, Tenancy

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
    with pytest.raises(Forbidden, match="replica refused"):
        t.check_carried(root, ALICE, "http://a:1")
    assert "replica refused" in caplog.text
    t.check_carried(root, BOB, "http://a:1")  # agreeing: accepted
    t = _tenancy(tmp_path)
    t.carried = lambda: [(root, ALICE, "http://a:1")]
    with pytest.raises(Forbidden):  # another peer's replica of it names another uid
        t.check_carried(root, BOB, "http://c:1")


def test_a_ticket_names_its_reader_for_reads_only(tmp_path, monkeypatch):
    t = _tenancy(tmp_path)
    root = str(tmp_path / "jobs" / "alice")
    t.carried = lambda: [(root, ALICE, "http://a:1")]
    ticket = t.vouch(_on_socket(ALICE))
    with pytest.raises(Forbidden):  # only a caller the kernel named gets one
        t.vouch(Caller(None, False))
    scope = {"headers": [(b"x-ckptd-vouch", ticket.encode())]}
    reader = t.caller(scope)
    assert reader.vouched and reader.uid == ALICE and not reader.operator
    t.check_read(reader, root)
    with pytest.raises(Forbidden):
        t.check_write(reader, root, bind=False)
    assert not t.owns(reader, ALICE)
    forged = f"{BOB} {ticket.split(' ', 1)[1]}"
    other_key = _tenancy(tmp_path / "other")
    other_key.peer_key = b"o" * 32
    for bad in (forged, other_key.vouch(_on_socket(ALICE)), "junk", ""):
        c = t.caller({"headers": [(b"x-ckptd-vouch", bad.encode())]})
        assert c.peer is None and not c.vouched, bad
    monkeypatch.setattr(time, "time", lambda: 10**10)  # expired
    assert t.caller(scope).peer is None
