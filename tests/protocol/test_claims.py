"""Step claims (``ckptd.claims``): ``begin``'s fencing -- a committed step, another live writer,
the same job's retry, a superseded attempt, an unreadable claim -- and ``reclaim``."""

from __future__ import annotations

import pytest

from ckptd import catalog, claims, errors
from ckptd.errors import CheckpointError
from tests.protocol.parts import SHARDS, ClaimReadsFail, committed_step, write_part


def test_begin_refuses_committed_steps_and_other_writers(store, monkeypatch):
    committed_step(store, 1)
    with pytest.raises(errors.AlreadyCommitted, match="already committed"):
        claims.begin(store, 1, "new", "job-a")
    claims.begin(store, 2, "a1", "job-a")
    claims.begin(store, 2, "a1", "job-a")  # another rank of the same attempt
    assert [n for n, _ in claims.claims(store, 2)] == [0]
    with pytest.raises(errors.StepClaimed, match="being written by job 'job-a'.*as job 'job-b'"):
        claims.begin(store, 2, "b1", "job-b")
    claims.begin(store, 2, "a2", "job-a")  # the same job again (a restart, a retry): takes over
    assert claims.owner(store, 2) == {**claims.owner(store, 2), "writer": "job-a", "attempt": "a2"}
    assert [n for n, _ in claims.claims(store, 2)] == [0, 1]
    monkeypatch.setenv("CKPTD_STALE_ATTEMPT_S", "0")  # job-a counts as dead at once
    claims.begin(store, 2, "b1", "job-b")
    assert claims.owner(store, 2)["writer"] == "job-b"


def test_reclaim_deletes_only_own_partial_steps(store):
    committed_step(store, 1)
    write_part(store, 2, "a", 0, 2, SHARDS)  # job-a's partial
    write_part(store, 3, "b", 0, 2, SHARDS, writer="job-b")  # another job's partial
    assert claims.reclaim(store, [1, 2, 3], "job-a") == [2]
    assert catalog.steps(store) == [1, 3]
    assert catalog.committed_steps(store) == [1]


def test_a_superseded_attempt_never_takes_the_step_back(store):
    claims.begin(store, 8, "a1", "job-a")
    claims.begin(store, 8, "a2", "job-a")  # the job's retry supersedes a1
    with pytest.raises(errors.StepClaimed, match="superseded by attempt 'a2'"):
        claims.begin(store, 8, "a1", "job-a")  # a1 resumed late (a daemon restart)
    assert claims.owner(store, 8)["attempt"] == "a2"


def test_an_unreadable_claim_is_a_storage_error_not_another_writer():
    store = ClaimReadsFail()
    claims.begin(store, 3, "a", "job")  # no claim yet: nothing to read
    with pytest.raises(CheckpointError, match="cannot read claim 000000.json") as e:
        claims.begin(store, 3, "a", "job")  # before: StepClaimed, "an unknown writer"
    assert not isinstance(e.value, errors.StepClaimed)
