"""A spilled replica comes back with the binding it carried (``Tenancy.carry``): the tier's real
table, the daemon's real staging budget and a real spill folder in this process. A replica of
alice's root (carrying uid 1002) is sealed and spilled; a fresh table on the same folder (the
restarted daemon) adopts it and names the root as bound to 1002, so a co-tenant on the peer
cannot read it after a restart. A spill file whose carried uid clashes with the restarted
daemon's own binding of that root is refused, logged once and removed."""

from __future__ import annotations

import logging
import time

import google_crc32c

from ckptd import manifest as mf
from ckptd.server.spill import Spill
from ckptd.server.staging import Staging
from ckptd.server.tiers import Tiers

ROOT, PEER, ALICE = "file:///jobs/alice", "http://127.0.0.1:9", 1002
KEY = f"{mf.step_dir(4)}/{mf.ARRAYS}/w/c/0"
DATA = b"alice's weights " * 64


def _table(tmp_path, name: str, bound=lambda root: None) -> Tiers:
    tiers = Tiers(Staging(tmp_path / name, budget=1 << 20), [], None, 0, None)
    tiers.spill, tiers.bound_uid = Spill(tmp_path / "spill"), bound
    return tiers


def _spill_a_replica(tmp_path) -> None:
    (tmp_path / "spill").mkdir(mode=0o700)
    tiers = _table(tmp_path, "staging-1")
    obj = {"key": KEY, "size": len(DATA), "crc32c": google_crc32c.value(DATA)}
    rid = tiers.begin_replica(ROOT, 4, "a4", PEER, [0], [obj], uid=ALICE)
    tiers.put_piece(rid, KEY, 0, DATA)
    tiers.seal(rid)
    deadline = time.monotonic() + 60
    while not all(c.get("spilled") for c in tiers.describe(ROOT)["replicas"]):
        assert time.monotonic() < deadline, tiers.describe(ROOT)
        time.sleep(0.05)
    _close(tiers)


def _close(tiers: Tiers) -> None:
    tiers.spill.close()
    tiers.staging.close()


def test_a_restarted_daemon_keeps_the_binding_its_spilled_replica_carried(tmp_path):
    _spill_a_replica(tmp_path)
    again = _table(tmp_path, "staging-2")
    assert again.adopt(lambda root: None) == 1
    assert again.carried() == [(ROOT, ALICE, PEER)]  # without it the root is unbound here
    assert bytes(again.read(ROOT, 4, "a4", KEY, 0, len(DATA))) == DATA
    _close(again)


def test_a_spilled_replica_whose_binding_clashes_is_not_adopted(tmp_path, caplog):
    _spill_a_replica(tmp_path)
    again = _table(tmp_path, "staging-2", bound=lambda root: 1003)  # bob holds that root here now
    with caplog.at_level(logging.WARNING, logger="ckptd.tiers"):
        assert again.adopt(lambda root: None) == 0
    refused = [r for r in caplog.records if "not adopted" in r.getMessage()]
    assert len(refused) == 1 and "uid 1002" in refused[0].getMessage(), caplog.text
    assert again.carried() == [] and list(again.spill.names()) == []
    _close(again)
