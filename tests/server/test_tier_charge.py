"""A held object costs the staging budget at least ``OBJECT_CHARGE`` bytes and its key
(``server.replication.charge``): a memory-only part or a replica of many zero-byte objects is
not free (before, each was charged 0 bytes while its key and table entries took daemon memory,
without bound and outside the budget)."""

from __future__ import annotations

import json
import os

import pytest

from ckptd import manifest as mf
from ckptd.daemon_conn import DaemonConnection
from ckptd.server.replication import OBJECT_CHARGE, part_mac
from ckptd.server.staging import Staging
from ckptd.server.tiers import Tiers
from tests.server.daemon import Daemon

pytestmark = pytest.mark.timeout(120)

TOKEN = "charge-test-token-0123456789abcdef"
BUDGET = 1 << 20


def _reserve(conn: DaemonConnection, root: str, step: int, objects: int) -> bool:
    """A rank's reservation before its hand-off, through the daemon's socket as trainers send it."""
    body = {"root": root, "step": step, "attempt": "a1", "rank": 0, "bytes": 0, "objects": objects}
    status, _, raw = conn.fetch("POST", "/v1/tiers/reserve", body)
    assert status == 200, raw
    return json.loads(raw)["ok"]


def _reserved(conn: DaemonConnection) -> int:
    status, _, raw = conn.fetch("GET", "/v1/tiers")
    assert status == 200, raw
    return json.loads(raw)["reserved_bytes"]


def test_a_hand_off_of_zero_byte_objects_is_charged_and_refused_past_the_budget(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    d = Daemon(  # as the docs start it: token on, trainers on its socket, no --trust-tcp
        [root],
        tmp_path / "staging",
        tmp_path / "d.log",
        token_file=tmp_path / "token",
        trust_tcp=False,
        CKPTD_BUDGET=str(BUDGET),
    )
    with d:
        conn = DaemonConnection(d.socket_url, TOKEN)
        try:
            n = 1000  # zero-byte objects: charged n x OBJECT_CHARGE (before: 0, and always room)
            assert _reserve(conn, root, 3, n) is True
            assert _reserved(conn) == n * OBJECT_CHARGE
            many = BUDGET // OBJECT_CHARGE + 1  # more than the budget holds: persisted instead
            assert _reserve(conn, root, 5, many) is False
            assert d.metric("ckptd_tier_persisted_instead_total", TOKEN) == 1
            assert d.logs().count("persisted to the job root instead") == 1
            assert _reserved(conn) == n * OBJECT_CHARGE  # nothing leaked
        finally:
            conn.close()


def test_held_and_replicated_zero_byte_objects_take_their_charge_and_give_it_back(tmp_path):
    staging = Staging(tmp_path / "staging", budget=BUDGET)
    try:
        tiers = Tiers(staging, [], None, 0, None)
        keys = [f"{mf.step_dir(2)}/state/o{i:04d}" for i in range(100)]
        cost = sum(OBJECT_CHARGE + len(k) for k in keys)
        store = tiers.holder("file:///job", 2, "a", 0)  # a rank's memory-only part, as the daemon writes it
        for k in keys:
            store.put(k, b"")
        assert staging.reserved_bytes == cost
        store.delete(keys[0])
        assert staging.reserved_bytes == cost - OBJECT_CHARGE - len(keys[0])
        tiers.failed("file:///job", 2, "a", 0)
        assert staging.reserved_bytes == 0
        objects = [{"key": k, "size": 0, "crc32c": 0} for k in keys]
        tiers.peer_key = b"k" * 32  # a memory-only replica carries its part's MAC (``part_mac``)
        mac = part_mac(tiers.peer_key, "file:///job", None, 2, "a", 0, dict.fromkeys(keys, b""))
        rid = tiers.begin_replica("file:///job", 2, "a", "http://peer", [0], objects, kind="memory_only", mac=mac)
        tiers.seal(rid)
        assert staging.reserved_bytes == cost
        (part,) = tiers.describe("file:///job")["memory_only"]
        assert part["bytes"] == 0 and part["objects"] == 100  # users see the real bytes
        tiers.fence("file:///job", 1)
        assert staging.reserved_bytes == 0
    finally:
        staging.close()


def test_a_peer_or_uid_past_its_share_is_refused_and_the_others_still_fit(tmp_path):
    """``Tiers.over_share``: each origin holds at most ``share`` of the budget (and object cap)."""
    staging = Staging(tmp_path / "staging", budget=BUDGET)
    try:
        tiers = Tiers(staging, [], None, 0, None)
        big = [{"key": f"{mf.step_dir(2)}/state/o{i}", "size": BUDGET // 8, "crc32c": 0} for i in range(3)]
        rid = tiers.begin_replica("file:///job", 2, "a", "http://peer", [0], big, kind="memory_only")
        assert rid  # 3/8 of the budget: within the peer's half
        more = [{"key": f"{mf.step_dir(3)}/state/o{i}", "size": BUDGET // 8, "crc32c": 0} for i in range(2)]
        assert tiers.begin_replica("file:///job", 3, "a", "http://peer", [0], more, kind="memory_only") == ""
        assert tiers.counters["over_share"] == 1
        # another origin (a uid handing off on this node) still has its own half
        assert tiers.reserve("file:///mine", 5, "a", 0, 3 * BUDGET // 8, 3, origin="uid 1002") is True
        assert tiers.reserve("file:///mine", 6, "a", 0, BUDGET // 4, 2, origin="uid 1002") is False
        usage = tiers.usage()
        assert usage["http://peer"]["bytes"] == 3 * (BUDGET // 8), usage
        assert usage["uid 1002"]["objects"] == 3, usage
        tiers.release_reservation("file:///mine", 5, "a", 0)
        assert tiers.begin_replica("file:///job", 3, "a", "http://peer", [0], more, kind="memory_only") == ""
        tiers.share = 1.0  # --tenant-share 1: no per-origin limit, the budget alone
        assert tiers.begin_replica("file:///job", 3, "a", "http://peer", [0], more, kind="memory_only")
    finally:
        staging.close()
