"""The daemon's shared claim (``ckptd.server.shared_claim.SharedClaim``): one ``begin`` per
attempt for the parts one process persists, its outcome shared, and one read of the commit
record for a node's jobs."""

from __future__ import annotations

import threading
import time

import pytest

from ckptd import claims, errors
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.server import shared_claim
from storage_backends import memory
from tests.protocol.parts import ClaimReadsFail


class _ClaimGate(memory.MemoryStore):
    """A store whose claim puts hold until ``release`` is set (a slow first claim), telling the
    test through ``entered`` that one is in flight."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def put_if_absent(self, key, data):
        if "/_claims/" in key:
            self.entered.set()
            assert self.release.wait(30)
        return super().put_if_absent(key, data)


def _claim_all(shared, store, step, attempt, writer, n=4, first=None):
    """``n`` threads claim (the first alone until ``first`` returns); their results, in order:
    None for a go, else the exception."""
    out: list = [None] * n

    def one(i):
        try:
            shared.claim(store, store.uri, step, attempt, writer)
        except CheckpointError as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    threads[0].start()
    if first is not None:
        first()
    for t in threads[1:]:
        t.start()
    if first is not None:
        time.sleep(0.05)  # let the others reach the running claim (the outcome holds either way)
        store.release.set()
    for t in threads:
        t.join(30)
    return out


def test_parts_of_one_attempt_share_one_running_claim():
    store = _ClaimGate()
    begins = []
    shared = shared_claim.SharedClaim(on_begin=lambda: begins.append(1))
    out = _claim_all(shared, store, 5, "a1", "job-a", first=lambda: store.entered.wait(30))
    assert out == [None] * 4
    assert len(begins) == 1
    assert [r["attempt"] for _, r in claims.claims(store, 5)] == ["a1"]
    shared.claim(store, store.uri, 5, "a1", "job-a")  # a late part: the go is still trusted
    assert len(begins) == 1


def test_a_refusal_is_shared_word_for_word():
    store = _ClaimGate()
    store.release.set()
    claims.begin(store, 5, "theirs", "job-other")
    begins = []
    shared = shared_claim.SharedClaim(on_begin=lambda: begins.append(1))
    out = _claim_all(shared, store, 5, "a1", "job-a")
    assert all(isinstance(e, errors.StepClaimed) for e in out), out
    assert len({str(e) for e in out}) == 1 and "job 'job-other'" in str(out[0])
    assert len({id(e) for e in out}) == 4  # each part's thread raises its own exception object
    assert len(begins) == 1
    assert [n for n, _ in claims.claims(store, 5)] == [0]


def test_a_transient_claim_failure_is_kept_for_nobody():
    store = ClaimReadsFail()
    claims.begin(store, 3, "a", "job")  # a claim to read: the next begins fail to read it
    begins = []
    shared = shared_claim.SharedClaim(on_begin=lambda: begins.append(1))
    for _ in range(2):
        with pytest.raises(CheckpointError, match="cannot read claim") as e:
            shared.claim(store, store.uri, 3, "a", "job")
        assert not isinstance(e.value, errors.StepClaimed | errors.AlreadyCommitted)
        assert len(shared) == 0
    assert len(begins) == 2  # the second part claimed again


def test_a_shared_go_is_trusted_for_a_quarter_of_the_stale_time(monkeypatch):
    monkeypatch.setenv("CKPTD_STALE_ATTEMPT_S", "0.4")  # a go is trusted for 0.1 s
    store = memory.MemoryStore()
    begins = []
    shared = shared_claim.SharedClaim(on_begin=lambda: begins.append(1))
    shared.claim(store, store.uri, 5, "a1", "job-a")
    time.sleep(0.15)
    shared.claim(store, store.uri, 5, "a1", "job-a")  # too old: claims again
    assert len(begins) == 2
    assert len(claims.claims(store, 5)) == 1  # begin is idempotent for the attempt


def test_the_shared_claims_table_is_bounded():
    store = memory.MemoryStore()
    shared = shared_claim.SharedClaim(limit=2)
    for step in range(1, 6):
        shared.claim(store, store.uri, step, "a1", "job-a")
    assert len(shared) == 2


def test_a_newer_attempts_go_voids_the_shared_go_of_the_old_one():
    """The job restarted (attempt a2 took the step over): a part of the dead attempt a1 still
    queued in the same daemon claims again and is refused, instead of writing on a1's old go."""
    store = memory.MemoryStore()
    begins = []
    shared = shared_claim.SharedClaim(on_begin=lambda: begins.append(1))
    shared.claim(store, store.uri, 5, "a1", "job-a")
    shared.claim(store, store.uri, 5, "a2", "job-a")  # the same job, restarted: takes the step over
    with pytest.raises(errors.StepClaimed, match="attempt a1 was superseded by attempt 'a2'"):
        shared.claim(store, store.uri, 5, "a1", "job-a")
    assert len(begins) == 3
    assert [r["attempt"] for _, r in claims.claims(store, 5)] == ["a1", "a2"]


class _CommitReadGate(memory.MemoryStore):
    """Counts GETs of commit records; the first waits for ``release`` (a read in flight)."""

    def __init__(self):
        super().__init__()
        self.reads, self.entered, self.release = 0, threading.Event(), threading.Event()

    def get(self, key, limit=None):
        if key.endswith(f"/{mf.COMMIT}"):
            self.reads += 1
            self.entered.set()
            assert self.release.wait(30)
        return super().get(key, limit)


def test_a_daemons_jobs_share_one_read_of_the_commit_record():
    """The jobs of a node hand off together: one GET of commit.json answers all of them, a
    later one reads again; a commit is seen once the answer is older than ``fresh_s``."""
    store = _CommitReadGate()
    shared = shared_claim.SharedClaim()
    out = []
    threads = [
        threading.Thread(target=lambda: out.append(shared.committed(store, "r", 5, fresh_s=60))) for _ in range(4)
    ]
    threads[0].start()
    assert store.entered.wait(30)
    for t in threads[1:]:
        t.start()
    time.sleep(0.05)  # let them reach the read in flight (the count below holds either way)
    store.release.set()
    for t in threads:
        t.join(30)
    assert out == [None] * 4 and store.reads == 1
    store.put(f"{mf.step_dir(5)}/{mf.COMMIT}", mf.dumps({"attempt": "a1"}))
    time.sleep(0.15)
    assert shared.committed(store, "r", 5, fresh_s=0.1) == {"attempt": "a1"}
    assert store.reads == 2
