"""The commit rules, one test each, on the live path (``commit.finish_rank`` -> ``climb`` ->
``_check_before_commit`` over the done tree); each fails if its rule is removed. Also the
consistency check ``ckptd verify`` runs on a committed step. Memory and local stores."""

from __future__ import annotations

import json

import pytest

from ckptd import catalog, claims, commit, donetree, errors
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from tests.protocol.parts import SHARDS, committed_step, finish, memory_only, pinned_record, save_part, write_part


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


def test_shards_beyond_the_manifests_block_the_commit(store):
    """The done records name the manifest's shards and nothing else: a shard outside the grid
    is refused (tests/protocol/test_commit_keys.py has the other ways to name a wrong key)."""
    extra = f"{mf.array_path('w')}/c/2/0"
    write_part(store, 10, "att", 0, 1, SHARDS)
    with pytest.raises(CheckpointError, match="name 1 shard keys not in the manifest, e.g. arrays/w/c/2/0"):
        finish(store, 10, "att", 0, 1, [*SHARDS, extra])
    assert catalog.read_commit(store, 10) is None


def test_check_consistency_sees_a_mixed_step(store):
    committed_step(store, 7, "a")
    m = catalog.load_manifest(store, 7)
    m.attempt = "b"  # a manifest written by another writer's attempt
    store.put(f"{mf.step_dir(7)}/{mf.MANIFEST}", m.to_bytes())
    found = commit.check_consistency(store, 7, catalog.load_manifest(store, 7))
    assert found and "commit.json names attempt 'a' but manifest.json 'b'" in found[0]


def test_step_bound():
    assert mf.step_dir(10**10 - 1) == "step_9999999999"
    with pytest.raises(CheckpointError, match="at most 9999999999"):
        mf.step_dir(10**10)


# -- one rule for the root and the memory tier --------------------------------------------------


def _save_pinned(store, step, shards_by_rank):
    """A step of ``len(shards_by_rank)`` ranks through the live path (``write_part``, then
    ``commit.finish_rank`` with ``pinned_record``s). Returns the commit record, or raises the
    commit rule's error."""
    world, committed = len(shards_by_rank), False
    for r, shards in enumerate(shards_by_rank):
        write_part(store, step, "att", r, world, shards)
    for r, shards in enumerate(shards_by_rank):
        rec = pinned_record(store, step, r, shards)
        committed = commit.finish_rank(store, step, "att", r, world, rec)
    assert committed
    return catalog.read_commit(store, step)


def test_a_memory_only_step_gets_the_record_its_commit_wrote(store):
    """The memory-only choice decides with the root's rule (``commit.whole_step``) and returns
    the record the commit wrote for the same records; only "time" is the moment of the
    decision (the commit's, the newest done record's)."""
    persisted = _save_pinned(store, 11, [SHARDS[:1], SHARDS[1:]])
    mem = memory_only(store, 11)
    assert mem["time"] == 1001.0
    assert mem == {**persisted, "time": mem["time"]}


def test_a_memory_only_step_the_rule_refuses_is_refused(store):
    """Both ranks name one shard and nobody the other: the root refuses it, and the memory-only
    choice refuses the same part set with the same reason."""
    with pytest.raises(CheckpointError, match="no rank wrote 1 shard objects the manifest needs") as root:
        _save_pinned(store, 12, [SHARDS[:1], SHARDS[:1]])
    with pytest.raises(CheckpointError) as mem:
        memory_only(store, 12)
    assert str(mem.value).split(": ", 1)[1] == str(root.value).split(": ", 1)[1]
