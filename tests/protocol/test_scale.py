"""The scalable commit (done tree) and the latest-step chain, run by hundreds of simulated ranks
on the simulated S3 with its faults: exactly one commit, never a partial one, and a
``latest_step`` that stays right when its chain is stale, missing, broken or ahead of the
commits."""

from __future__ import annotations

import json
import random
import time

import pytest

from ckptd import catalog, claims, commit, donetree, errors, latest, persist
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import MemoryStore
from tests.doubles.simulated import SimulatedStore, VirtualClock, VirtualTime


def _claim_with_manifest(store, step: int, attempt: str, n: int) -> None:
    """What rank 0 does before the done records: claim the step, write the manifest (no
    tensors here, so no shard is expected)."""
    claims.begin(store, step, attempt, "job")
    m = mf.Manifest(step=step, world_size=n, tensors={}, state={}, attempt=attempt)
    store.put(f"{mf.step_dir(step)}/{mf.MANIFEST}", m.to_bytes())


def _finish_all(
    n: int, *, seed: int, skip: frozenset[int] = frozenset(), twice: frozenset[int] = frozenset(), **faults
) -> tuple[SimulatedStore, list[int]]:
    """n simulated ranks finish step 7 at skewed times through the real ``finish_rank``;
    returns the store and the ranks for which it returned True."""
    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, sigma=0.5, seed=seed, attempts=20, **faults)
    _claim_with_manifest(store, 7, "a", n)
    rng = random.Random(seed)
    winners: list[int] = []

    def rank(r: int) -> None:
        record = {"rank": r, "bytes": 1000 + r, "objects": 2}
        if r in twice:  # a rank whose done record is written twice (a retried save of it)
            donetree.write_done(store, 7, "a", r, {**record, "bytes": 1})
        if commit.finish_rank(store, 7, "a", r, n, record):
            winners.append(r)

    for r in range(n):
        if r not in skip:
            clock.spawn(lambda r=r: rank(r), at=rng.uniform(0, 0.3))
    clock.run(timeout=300)
    return store, winners


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exactly_once_under_slowdowns_errors_and_lost_responses(seed):
    n = 300  # two levels: five groups of 64, then the root
    store, winners = _finish_all(n, seed=seed, put_limit=20, get_limit=30, error_rate=0.05, lost_rate=0.05)
    assert store.stats.slowdowns > 0 and store.stats.errors > 0  # the faults happened
    assert len(winners) == 1
    commit = json.loads(store.inner.get(f"{mf.step_dir(7)}/{mf.COMMIT}"))
    assert commit["world_size"] == n and commit["attempt"] == "a"
    assert commit["bytes"] == sum(1000 + r for r in range(n)) and commit["objects"] == 2 * n
    assert donetree.count_done(store.inner, 7, "a") == n
    for r in (0, 63, 64, 299):
        assert catalog.read_done_record(store.inner, 7, "a", r)["rank"] == r


@pytest.mark.parametrize("missing", [0, 64, 299])
def test_never_committed_while_a_rank_is_missing(missing):
    store, winners = _finish_all(300, seed=3, skip=frozenset({missing}))
    assert winners == []
    assert not store.inner.exists(f"{mf.step_dir(7)}/{mf.COMMIT}")
    # nor any node above the missing rank's group
    nodes = [i.key for i in store.inner.list(f"{mf.step_dir(7)}/{mf.DONE}/a/t2/")]
    assert len(nodes) == 4 and all(f"/n{missing // 64:06d}." not in k for k in nodes)
    assert catalog.latest_step(store.inner) is None


def test_a_rank_written_twice_is_counted_once():
    store, winners = _finish_all(130, seed=4, twice=frozenset({5, 70}))
    assert len(winners) == 1
    commit = json.loads(store.inner.get(f"{mf.step_dir(7)}/{mf.COMMIT}"))
    assert commit["world_size"] == 130  # counted by rank id; one of the two records' totals


def test_levels():
    assert [donetree.levels(n) for n in (1, 64, 65, 4096, 4097, 8192)] == [1, 1, 2, 2, 3, 3]


def test_commit_costs_o_n_requests_and_no_folder_holds_more_than_a_group():
    n = 512
    store, winners = _finish_all(n, seed=5)
    assert len(winners) == 1
    # a done record and a LIST per rank; the group nodes, their LISTs and the chain are a few
    # percent more (more when ranks finish together and race to complete the same node)
    assert store.stats.total() <= 2.5 * n
    assert store.stats.slowdowns == 0
    assert max(n for (cls, _), n in store.stats.peak.items() if cls == "PUT") <= 64


def test_old_layout_done_records_are_still_read():
    store = MemoryStore()
    store.put(mf.done_key(3, "old", 1), mf.dumps({"rank": 1, "rng": "x"}))
    assert catalog.read_done_record(store, 3, "old", 1) == {"rank": 1, "rng": "x"}


# -- the latest-step chain ----------------------------------------------------------------------


def _commit_old_style(store, step: int) -> None:
    """A checkpoint committed by a ckptd that had no chain: only its commit record."""
    store.put(f"{mf.step_dir(step)}/{mf.MANIFEST}", b"{}")
    store.put(f"{mf.step_dir(step)}/{mf.COMMIT}", mf.dumps({"step": step}))


def _commit(store, step: int) -> bool:
    return commit.commit_step(store, step, {"step": step})


def test_a_root_without_chain_is_listed_and_the_first_commit_seeds_it_past_old_steps():
    store = MemoryStore()
    for s in (10, 20, 30):
        _commit_old_style(store, s)
    assert catalog.latest_step(store) == 30  # no chain: listing
    assert _commit(store, 25)  # an older step committed late: the chain starts at 30, not 25
    assert json.loads(store.get(latest.FIRST)) == 30
    assert latest.latest_from_chain(store) == (True, 30)
    assert _commit(store, 40)
    assert latest.latest_from_chain(store) == (True, 40) and catalog.latest_step(store) == 40


def test_stale_and_missing_hints_are_walked_past():
    store = MemoryStore()
    for s in (1, 2, 3, 4):
        assert _commit(store, s)
    store.put(latest.HINT, b"2")  # a slow committer moved it back
    assert catalog.latest_step(store) == 4
    store.delete(latest.HINT)
    assert catalog.latest_step(store) == 4  # from the chain's first element
    store.put(latest.HINT, b"not json")
    assert catalog.latest_step(store) == 4  # malformed: listing


def test_a_chain_end_that_never_committed_falls_back_to_listing():
    store = MemoryStore()
    assert _commit(store, 100)
    assert latest.link(store, 200, catalog.latest_step_by_listing)  # its save died after linking
    assert latest.latest_from_chain(store) == (True, 100)  # the hint, and nothing after it
    assert catalog.latest_step(store) == 100
    assert _commit(store, 150)  # the job resumed from 100 and saves 150 < 200: not linked
    assert catalog.latest_step(store) == 150  # a folder after the hint
    store.delete(latest.HINT)
    assert latest.latest_from_chain(store) == (False, None)  # the chain's end never committed
    assert catalog.latest_step(store) == 150  # listing
    assert _commit(store, 300)
    assert latest.latest_from_chain(store) == (True, 300)


def test_a_deleted_chain_end_falls_back_to_listing():
    store = MemoryStore()
    for s in (1, 2, 3):
        assert _commit(store, s)
    catalog.delete_checkpoint(store, 3)  # by hand: retention never deletes the newest
    assert catalog.latest_step(store) == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_racing_commits_of_many_steps_keep_the_chain_increasing(seed):
    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, sigma=0.8, seed=seed, lost_rate=0.05)
    rng = random.Random(seed)
    steps = rng.sample(range(1, 1000), 60)
    for s in steps:  # out of order, overlapping: daemons may commit a later step first
        clock.spawn(lambda s=s: _commit(store, s), at=rng.uniform(0, 0.2))
    clock.run(timeout=300)
    chain, cur = [], json.loads(store.inner.get(latest.FIRST))
    while True:
        chain.append(cur)
        if not store.inner.exists(latest.link_key(cur)):
            break
        cur = json.loads(store.inner.get(latest.link_key(cur)))
    assert chain == sorted(set(chain)) and chain[-1] == max(steps)
    assert latest.latest_from_chain(store.inner) == (True, max(steps))


def test_latest_step_costs_three_requests_whatever_the_steps_kept():
    store = SimulatedStore()
    for s in range(0, 3000):
        _commit(store.inner, s)
    store.reindex()
    store.stats.reset()
    assert catalog.latest_step(store) == 2999
    assert store.stats.total() == 3


def test_a_thousand_waiting_ranks_poll_under_the_prefix_rate(monkeypatch):
    # 1024 ranks finish within 0.1 s and wait 3 s for the commit. Polling from 5 ms doubling
    # (the pace before) HEADs commit.json ~15,000 times in the first 0.3 s: SlowDown, and with
    # no retries left a rank's save fails. Paced polling stays near 2000/s from the first poll.
    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, sigma=0.3, attempts=1, seed=1)
    monkeypatch.setattr(commit, "time", VirtualTime(clock))
    n, failed = 1024, []

    def rank(r: int) -> None:
        try:
            commit.wait_commit(store, 9, "a", n, timeout=60.0, rank=r)
        except Exception as e:  # noqa: BLE001 - counted
            failed.append(e)

    for r in range(n):
        clock.spawn(lambda r=r: rank(r), at=r * 1e-4)
    clock.spawn(lambda: store.put(f"{mf.step_dir(9)}/{mf.COMMIT}", b'{"attempt":"a"}'), at=3.0)
    clock.run(timeout=300)
    assert failed == [] and store.stats.slowdowns == 0
    assert store.stats.peak[("GET", mf.step_dir(9))] <= 3500


@pytest.mark.parametrize("notices", [True, False])
def test_above_1024_ranks_waiters_poll_notices_and_fall_back_to_the_commit_record(monkeypatch, notices):
    # The committer writes commit.json, then one notice per 1024 ranks; the waiting ranks poll
    # their notice. When the committer dies between the two (notices=False), they still learn
    # of the commit from commit.json, which every rank checks every few polls.
    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, sigma=0.3, attempts=1, seed=2)
    monkeypatch.setattr(commit, "time", VirtualTime(clock))
    n, returned, failed = 2048, [], []
    keys = donetree.notice_keys(9, "a", n)
    assert len(keys) == 2 and len({k.rsplit("/", 1)[0] for k in keys}) == 2  # two prefixes

    def rank(r: int) -> None:
        try:
            commit.wait_commit(store, 9, "a", n, timeout=120.0, rank=r)
            returned.append(r)
        except Exception as e:  # noqa: BLE001 - counted
            failed.append(e)

    def committer() -> None:
        store.put(f"{mf.step_dir(9)}/{mf.COMMIT}", b'{"attempt":"a"}')
        if notices:
            for k in keys:
                store.put(k, b"{}")

    for r in range(n):
        clock.spawn(lambda r=r: rank(r), at=r * 1e-4)
    clock.spawn(committer, at=3.0)
    clock.run(timeout=300)
    assert failed == [] and len(returned) == n and store.stats.slowdowns == 0
    notice_polls = sum(v for (verb, p), v in store.stats.by_prefix.items() if verb == "HEAD" and "/c000" in p)
    assert store.stats.peak[("GET", mf.step_dir(9))] <= 3500
    assert notice_polls > 0


def test_a_committed_save_of_more_than_1024_ranks_writes_its_notices():
    store, winners = _finish_all(1100, seed=6)
    assert len(winners) == 1
    assert all(store.inner.exists(k) for k in donetree.notice_keys(7, "a", 1100))


# -- the claim at the start of a save: rank 0 claims, the others read its outcome ------------------


def _save_all(n: int, *, seed: int = 0, ranks=None, writer: str = "job", timeout: float = 600.0, **faults):
    """``n`` simulated ranks start ``persist`` of step 7 (attempt "a") within 10 ms, as after
    the collective ``save()``; each uploads for 5 s (a sleep in its first data put), so the
    claim phase is over before any rank's commit traffic. Returns the store, each rank's result
    or exception, and (SlowDowns, requests by prefix) counted when the last rank started its
    upload (the end of the claim phase)."""
    from benchmarks.scale import ClockPool, InlinePool, _job, virtual_time

    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, sigma=0.3, seed=seed, **faults)
    rng = random.Random(seed)
    out: dict = {}
    uploading: list[int] = []
    claim_phase: list[int] = []
    orig = store.put_new

    def put_new(key, data):
        if "/arrays/t0/" in key:
            uploading.append(1)
            if len(uploading) == n:
                claim_phase.append((store.stats.slowdowns, store.stats.by_prefix.copy()))
            clock.sleep(5.0)
        return orig(key, data)

    store.put_new = put_new

    def rank(r: int) -> None:
        pool = ClockPool(clock) if r == 0 else InlinePool()
        try:
            out[r] = persist.persist(
                store, _job(7, "a", r, n, 1), pool, writer=writer, commit_timeout=timeout, heartbeat=False
            )
        except Exception as e:  # noqa: BLE001 - a result
            out[r] = e

    with virtual_time(clock):
        for r in range(n) if ranks is None else ranks:
            clock.spawn(lambda r=r: rank(r), at=rng.uniform(0, 0.01))
        clock.run(timeout=600)
    return store, out, claim_phase


def _claims_peak(store) -> int:
    return max((c for (_, pre), c in store.stats.peak.items() if f"/{mf.CLAIMS}" in pre), default=0)


def test_two_thousand_ranks_claim_a_step_without_a_burst():
    # Every rank's begin() listed <step>/_claims and read the newest claim: 2N requests on one
    # prefix within ~50 ms (4000 here, SlowDowns from ~2750 ranks). Rank 0 claims alone now and
    # the others poll their group's outcome: no prefix of the claims sees more than a few
    # hundred reads in any second, whatever N, and the save commits.
    n = 2000
    store, out, claim_phase = _save_all(n)
    assert all(isinstance(r, persist.SaveResult) for r in out.values()), next(
        r for r in out.values() if not isinstance(r, persist.SaveResult)
    )
    assert sum(r.committed_here for r in out.values()) == 1
    (slowdowns, by_prefix), *_ = claim_phase
    assert slowdowns == 0 and store.stats.slowdowns == 0
    assert _claims_peak(store) <= 1000
    claims = sum(c for (_, pre), c in by_prefix.items() if f"/{mf.CLAIMS}" in pre)
    assert claims <= 6 * n  # O(N): the outcome polls, ~3 per rank
    assert by_prefix[("LIST", f"{mf.step_dir(7)}/{mf.CLAIMS}")] == 1  # only rank 0 looked
    assert by_prefix[("HEAD", mf.step_dir(7))] == 1  # and only rank 0 checked for a commit


def test_outcomes_survive_500s_and_lost_responses():
    store, out, _ = _save_all(300, seed=5, error_rate=0.03, lost_rate=0.03)
    assert store.stats.errors > 0
    assert all(isinstance(r, persist.SaveResult) for r in out.values())
    assert sum(r.committed_here for r in out.values()) == 1
    assert catalog.read_commit(store.inner, 7)["world_size"] == 300


def _data_keys(store, step: int) -> list[str]:
    return [i.key for i in store.inner.list(f"{mf.step_dir(step)}/{mf.ARRAYS}/")]


@pytest.mark.parametrize("case", ["other_writer", "committed"])
def test_a_refused_claim_fails_every_rank_with_rank_0s_error_and_writes_no_data(case):
    pre = MemoryStore()
    if case == "other_writer":  # another job claimed step 7 just now and is writing it
        pre.put(claims.claim_key(7, 0), mf.dumps({"writer": "other-job", "attempt": "x", "time": 1.7e9}))
        pre.put(f"{mf.step_dir(7)}/{mf.ARRAYS}/w/c/0", b"theirs")
        expected, match = errors.StepHeld, "being written by job 'other-job'"
    else:
        pre.put(f"{mf.step_dir(7)}/{mf.COMMIT}", b'{"attempt":"x"}')
        expected, match = errors.AlreadyCommitted, "already committed"
    before = {i.key for i in pre.list()}
    n = 300
    clock = VirtualClock()
    # the store's clock is real time (mtimes); the protocol's is virtual, from real time now, so
    # that the other job's objects read as written just now (a time far ahead of the protocol's
    # clock is no evidence of life: leases.clamp)
    store = SimulatedStore(clock, latency=0.02, sigma=0.3, inner=pre)
    store.put_new = _no_data(store.put_new)
    from benchmarks.scale import ClockPool, InlinePool, _job, virtual_time

    out: dict = {}

    def rank(r: int) -> None:
        pool = ClockPool(clock) if r == 0 else InlinePool()
        try:
            out[r] = persist.persist(
                store, _job(7, "a", r, n, 1), pool, writer="job", commit_timeout=3600.0, heartbeat=False
            )
        except Exception as e:  # noqa: BLE001 - a result
            out[r] = e

    with virtual_time(clock, epoch=time.time()):
        for r in range(n):
            clock.spawn(lambda r=r: rank(r), at=r * 1e-5)
        clock.run(timeout=300)
    # every rank fails with rank 0's error (not at the 3600 s deadline: the refusal is published)
    assert all(type(e) is expected and match in str(e) for e in out.values()), out[1]
    # only rank 0 looked: one check for a commit, one listing of the claims (none when committed)
    assert store.stats.by_prefix[("HEAD", mf.step_dir(7))] == 1
    assert store.stats.by_prefix[("LIST", f"{mf.step_dir(7)}/{mf.CLAIMS}")] == int(case == "other_writer")
    added = {i.key for i in pre.list()} - before
    assert added == {f"{mf.step_dir(7)}/_claims/a/{g:06d}/go.json" for g in range(5)}  # the refusal only


def _no_data(put):
    def put_new(key, data):
        raise AssertionError(f"a refused rank wrote {key}")

    return put_new


def test_ranks_whose_rank_0_never_claims_fail_at_their_deadline_and_write_nothing():
    n = 200
    store, out, _ = _save_all(n, ranks=range(1, n), timeout=30.0)
    assert sorted(out) == list(range(1, n))
    assert all(type(e) is CheckpointError and "rank 0 did not claim step 7" in str(e) for e in out.values()), out[1]
    assert [i.key for i in store.inner.list()] == []  # no claim, no data, nothing


def test_a_stale_go_is_not_trusted(monkeypatch):
    # Rank 0 said go long ago (a save resumed much later); since then the step was taken over.
    # A rank reading that go runs begin() itself and is refused instead of writing.
    store = MemoryStore()
    claims.begin(store, 7, "a", "job")
    store.put(
        claims.outcome_key(7, "a", 0),
        mf.dumps({"ok": True, "writer": "job", "attempt": "a", "time": 1.0}),  # 1970
    )
    monkeypatch.setenv("CKPTD_STALE_ATTEMPT_S", "0")
    claims.begin(store, 7, "b", "other-job")  # job is dead: taken over
    with pytest.raises(errors.StepClaimed, match="superseded"):
        claims.follow_claim(store, 7, "a", "job", 5, timeout=5.0)
    # a fresh go is trusted without reading the claims
    store.put(claims.outcome_key(7, "c", 0), mf.dumps({"ok": True, "writer": "job", "attempt": "c", "time": 9e9}))
    claims.follow_claim(store, 7, "c", "job", 5, timeout=5.0)


def test_refusal_records_do_not_keep_a_dead_jobs_step_alive(tmp_path):
    # A job retrying a step another (dead) job left behind is refused each time; its refusal
    # records must not count as activity, or the step would never go stale for it.
    import os

    from storage_backends import open_store

    store = open_store(str(tmp_path / "root"))
    claims.begin(store, 7, "x", "dead-job")
    store.put(f"{mf.step_dir(7)}/{mf.ARRAYS}/w/c/0", b"theirs")
    old = 1_000_000_000
    for dirpath, _, files in os.walk(tmp_path / "root"):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
    refusal = {"ok": False, "writer": "job", "attempt": "r", "time": 1.0}
    store.put(f"{mf.step_dir(7)}/_claims/r/000000/go.json", mf.dumps(refusal))
    claims.begin(store, 7, "a", "job")  # stale (idle since 2001): taken over
    assert claims.owner(store, 7)["writer"] == "job"
