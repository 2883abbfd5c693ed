"""Liveness by lease (issue 26 part 1, issue 27 item 5): a claim stays alive while its attempt
renews its heartbeat, a forged or skewed time cannot keep it alive, claim numbers are total,
a takeover clears the superseded attempt's objects, and ``reclaim`` deletes only the caller's
own attempts."""

from __future__ import annotations

import time

import pytest

from ckptd import catalog, claims, errors, leases
from ckptd import manifest as mf
from storage_backends import MemoryStore
from tests import load
from tests.protocol.parts import SHARDS, write_part


def test_a_heartbeat_keeps_a_claim_alive_past_its_lease(monkeypatch):
    monkeypatch.setenv("CKPTD_CLAIM_LEASE_S", "0.4")
    store = MemoryStore()
    claims.begin(store, 2, "a1", "job-a")
    with leases.Heartbeat(store, 2, "a1", 0):
        end = time.monotonic() + 1.2  # three leases, renewed every 0.1 s
        while time.monotonic() < end:
            with pytest.raises(errors.StepClaimed, match="last heartbeat"):
                claims.begin(store, 2, "b1", "job-b")
            time.sleep(0.05)
    deadline = load.deadline(30)
    while True:  # stopped: the lease runs out and job-b takes over
        try:
            claims.begin(store, 2, "b1", "job-b")
            break
        except errors.StepClaimed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert claims.owner(store, 2)["writer"] == "job-b"


def test_storage_times_are_clamped():
    now = 1_000.0
    assert leases.clamp(990.0, now) == 990.0
    assert leases.clamp(1_030.0, now) == now  # a storage clock a little ahead: now
    assert leases.clamp(now + 10 * 365 * 86400, now) == 0.0  # forged: no evidence of life
    assert leases.clamp(float("nan"), now) == 0.0


def test_claim_numbering_is_total():
    store = MemoryStore()
    store.put(claims.claim_key(5, 999999), mf.dumps({"writer": "x", "attempt": "x1", "time": 0}))
    assert claims.claim_key(5, 1000000).endswith("/1000000.json")
    store.put(claims.claim_key(5, 1000000), mf.dumps({"writer": "y", "attempt": "y1", "time": 0}))
    store.put(f"{mf.step_dir(5)}/{mf.CLAIMS}/0000001.json", b"{}")  # not canonical: ignored
    assert [n for n, _ in claims.claims(store, 5)] == [999999, 1000000]
    assert claims.owner(store, 5)["writer"] == "y"


def test_a_takeover_clears_the_superseded_attempt_but_not_the_claims():
    store = MemoryStore()
    write_part(store, 4, "a1", 0, 2, SHARDS)
    store.put(f"{mf.step_dir(4)}/_done/a1/t1/000000/r0.json", b"{}")
    claims.begin(store, 4, "a2", "job-a")  # the job restarted: takes over, clears
    keys = [o.key[len(mf.step_dir(4)) + 1 :] for o in store.list(f"{mf.step_dir(4)}/")]
    assert keys == ["_claims/000000.json", "_claims/000001.json"], keys


def test_reclaim_spares_a_step_another_attempt_of_the_job_took_over():
    store = MemoryStore()
    write_part(store, 6, "a1", 0, 1, SHARDS)  # this process's failed save
    claims.begin(store, 6, "a2", "job-a")  # a restarted process of the same job took it over
    store.put(f"{mf.step_dir(6)}/{SHARDS[0]}", b"a2's data")
    assert claims.reclaim(store, [6], "job-a", {"a1"}) == []
    assert store.get(f"{mf.step_dir(6)}/{SHARDS[0]}") == b"a2's data"
    assert claims.reclaim(store, [6], "job-a", {"a2"}) == [6]
    assert catalog.steps(store) == []
