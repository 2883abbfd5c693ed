"""The commit protocol's pieces on their own: ``begin`` (claims), the commit rules on the live
path (``commit.finish_rank`` / ``climb`` / ``_check_before_commit`` over the done tree), ``reclaim``,
the consistency check of ``verify``, and retention.

Run on the memory store and on the local filesystem store (real files)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from ckptd import catalog, claims, commit, donetree, errors, persist, retention
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, encode_shard
from ckptd.errors import CheckpointError
from ckptd.server import shared_claim
from storage_backends import StorageError, memory, open_store

LAYOUT = ArrayLayout((4, 2), "float32", (2, 2), (2, 2))  # two shards
SHARDS = [f"{mf.array_path('w')}/{LAYOUT.shard_key((i, 0))}" for i in range(2)]


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    if request.param == "memory":
        name = f"commit-{tmp_path.name}"
        memory.reset(name)
        s = open_store(f"memory://{name}")
    else:
        s = open_store(str(tmp_path / "root"))
    yield s
    s.close()


def write_part(store, step, attempt, rank, world_size, shards, writer="job-a", manifest=None):
    """What ``persist.persist`` writes for one rank before its done record: the claim, its
    shards, and (rank 0) the manifest -- ``manifest`` = (attempt, world size) it names, by
    default this part's."""
    claims.begin(store, step, attempt, writer)
    folder = mf.step_dir(step)
    for i, key in enumerate(SHARDS):
        if key in shards:
            block = np.full((2, 2), rank * 10 + i, dtype=np.float32)
            store.put(f"{folder}/{key}", encode_shard(LAYOUT, (i, 0), block))
    if rank == 0:
        m_attempt, m_world = manifest or (attempt, world_size)
        m = mf.Manifest(step, m_world, {"w": mf.TensorEntry("w", LAYOUT)}, {}, m_attempt)
        for key, data in persist.manifest_objects(m):
            store.put(f"{folder}/{key}", data)


def finish(store, step, attempt, rank, world_size, shards, writer="job-a", extra=None):
    """The live commit path of one rank: its done record into the done tree, then the climb
    (``commit.finish_rank``); True if this rank wrote the commit record."""
    rec = {"rank": rank, "writer": writer, "bytes": 16, "objects": len(shards), "shards": list(shards)}
    return commit.finish_rank(store, step, attempt, rank, world_size, rec, extra)


def save_part(store, step, attempt, rank, world_size, shards, writer="job-a", manifest=None):
    write_part(store, step, attempt, rank, world_size, shards, writer, manifest)
    return finish(store, step, attempt, rank, world_size, shards, writer)


def committed_step(store, step, attempt="a0"):
    assert save_part(store, step, attempt, 0, 1, SHARDS)


# -- the commit rules, one test each, on the live path (finish_rank -> climb -> _check_before_commit)


def test_the_commit_waits_for_every_rank_then_is_written_once(store):
    write_part(store, 3, "att", 0, 2, SHARDS[:1])
    write_part(store, 3, "att", 1, 2, SHARDS[1:])
    assert not finish(store, 3, "att", 0, 2, SHARDS[:1])  # rank 1 has not finished
    assert catalog.read_commit(store, 3) is None
    assert finish(store, 3, "att", 1, 2, SHARDS[1:])
    rec = catalog.read_commit(store, 3)
    assert (rec["step"], rec["attempt"], rec["writer"], rec["world_size"], rec["bytes"], rec["objects"]) == (
        3,
        "att",
        "job-a",
        2,
        32,
        2,
    )
    # a rank (or daemon) finishing again races on the same step: it does not write it again
    assert not commit.climb(store, 3, "att", 1, 2, {"note": "x"})
    assert json.loads(store.get(f"{mf.step_dir(3)}/{mf.COMMIT}")) == rec
    assert commit.check_consistency(store, 3, catalog.load_manifest(store, 3)) == []


def test_the_commit_record_carries_the_callers_fields(store):
    write_part(store, 4, "att", 0, 1, SHARDS)
    assert finish(store, 4, "att", 0, 1, SHARDS, extra={"note": "x"})
    assert catalog.read_commit(store, 4)["note"] == "x"


def test_done_records_of_another_attempt_are_ignored(store):
    """Both ranks of the old attempt have done records; the new attempt (which took the step
    over) has one of two: the old records do not complete the new attempt's tree."""
    assert not save_part(store, 4, "old", 0, 2, SHARDS)
    donetree.write_done(store, 4, "old", 1, {"rank": 1, "writer": "job-a", "bytes": 0, "objects": 0, "shards": []})
    write_part(store, 4, "new", 0, 2, SHARDS)  # the job's next attempt takes the step over
    assert not finish(store, 4, "new", 0, 2, SHARDS)
    assert catalog.read_commit(store, 4) is None


def test_the_claim_must_be_the_committing_attempts(store):
    write_part(store, 5, "old", 0, 1, SHARDS)
    claims.begin(store, 5, "new", "job-a")  # the job's retry supersedes "old"
    with pytest.raises(errors.StepClaimed, match="claimed by job 'job-a' \\(attempt 'new'\\)"):
        finish(store, 5, "old", 0, 1, SHARDS)
    assert catalog.read_commit(store, 5) is None


def test_the_manifest_must_exist(store):
    write_part(store, 6, "att", 0, 1, SHARDS)
    store.delete(f"{mf.step_dir(6)}/{mf.MANIFEST}")
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        finish(store, 6, "att", 0, 1, SHARDS)
    assert catalog.read_commit(store, 6) is None


def test_the_manifest_must_name_this_attempt(store):
    write_part(store, 7, "att", 0, 1, SHARDS, manifest=("other", 1))
    with pytest.raises(CheckpointError, match="manifest names step 7, attempt 'other', world size 1"):
        finish(store, 7, "att", 0, 1, SHARDS)
    assert catalog.read_commit(store, 7) is None


def test_the_manifest_must_name_this_world_size(store):
    write_part(store, 8, "att", 0, 1, SHARDS, manifest=("att", 2))
    with pytest.raises(
        CheckpointError, match="of world size 1: the manifest names step 8, attempt 'att', world size 2"
    ):
        finish(store, 8, "att", 0, 1, SHARDS)
    assert catalog.read_commit(store, 8) is None


def test_every_shard_must_be_accounted_for(store):
    write_part(store, 9, "att", 0, 2, SHARDS[:1])
    write_part(store, 9, "att", 1, 2, SHARDS[:1])  # both ranks name the same shard; nobody the other
    assert not finish(store, 9, "att", 0, 2, SHARDS[:1])
    with pytest.raises(CheckpointError, match="no rank wrote 1 shard objects the manifest needs"):
        finish(store, 9, "att", 1, 2, SHARDS[:1])
    assert catalog.read_commit(store, 9) is None


def test_shards_beyond_the_manifests_do_not_block_the_commit(store):
    """A rank may write more than the manifest needs (the digests differ; nothing is missing)."""
    extra = f"{mf.array_path('w')}/unused"
    write_part(store, 10, "att", 0, 1, SHARDS)
    assert finish(store, 10, "att", 0, 1, [*SHARDS, extra])
    assert catalog.read_commit(store, 10)["attempt"] == "att"


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


def test_check_consistency_sees_a_mixed_step(store):
    committed_step(store, 7, "a")
    m = catalog.load_manifest(store, 7)
    m.attempt = "b"  # a manifest written by another writer's attempt
    store.put(f"{mf.step_dir(7)}/{mf.MANIFEST}", m.to_bytes())
    found = commit.check_consistency(store, 7, catalog.load_manifest(store, 7))
    assert found and "commit.json names attempt 'a' but manifest.json 'b'" in found[0]


def test_select_for_deletion_keeps_newest_and_never_newer_partials(store):
    for s in (1, 2, 3, 5):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"partial older than the newest commit")
    store.put(f"{mf.step_dir(6)}/arrays/x/c/0", b"partial newer than the newest commit (in flight)")
    assert retention.select_for_deletion(store, 2) == [1, 2, 4]
    assert retention.select_for_deletion(store, 2, protect={2}) == [1, 4]
    assert retention.select_for_deletion(store, 10) == [4]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        retention.select_for_deletion(store, 0)
    assert catalog.steps(store) == [1, 2, 3, 4, 5, 6]  # selecting deletes nothing


def test_retain_deletes_what_it_selects(store):
    for s in (1, 2, 3):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"in flight")
    assert retention.retain(store, 1) == [1, 2]
    assert catalog.steps(store) == [3, 4]
    assert catalog.committed_steps(store) == [3]
    assert retention.retain(store, 1) == []


def test_select_for_deletion_on_a_root_without_commits(store):
    store.put(f"{mf.step_dir(1)}/arrays/x/c/0", b"partial")
    assert retention.select_for_deletion(store, 1) == []


def test_step_bound():
    assert mf.step_dir(10**10 - 1) == "step_9999999999"
    with pytest.raises(CheckpointError, match="at most 9999999999"):
        mf.step_dir(10**10)


def test_a_superseded_attempt_never_takes_the_step_back(store):
    claims.begin(store, 8, "a1", "job-a")
    claims.begin(store, 8, "a2", "job-a")  # the job's retry supersedes a1
    with pytest.raises(errors.StepClaimed, match="superseded by attempt 'a2'"):
        claims.begin(store, 8, "a1", "job-a")  # a1 resumed late (a daemon restart)
    assert claims.owner(store, 8)["attempt"] == "a2"


class _ClaimReadsFail(memory.MemoryStore):
    """A store whose GETs of claim records fail (as S3 answers SlowDown after every retry)."""

    def get(self, key, limit=None):
        if "/_claims/" in key:
            raise StorageError(f"{self.uri}: 503 SlowDown for {key}")
        return super().get(key, limit)


def test_an_unreadable_claim_is_a_storage_error_not_another_writer():
    store = _ClaimReadsFail()
    claims.begin(store, 3, "a", "job")  # no claim yet: nothing to read
    with pytest.raises(CheckpointError, match="cannot read claim 000000.json") as e:
        claims.begin(store, 3, "a", "job")  # before: StepClaimed, "an unknown writer"
    assert not isinstance(e.value, errors.StepClaimed)


# -- SharedClaim: one claim per attempt for the parts one process persists (the daemon) ----------


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
    store = _ClaimReadsFail()
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
