"""The commit's shard check names keys: a done record names each shard it wrote once, spelled as
its grid spells it (``<array>/c/<i>/<j>...``: plain decimal coordinates below 2**24, one arity
per array), and the shard digest is keyed by the step, the attempt, the array path and its arity.

Each attack is performed for real on a local root and on a moto S3 root: through the live write
path (``commit.finish_rank``: refused when the record is written, or at the commit), and by
writing the record straight into the done tree, as a writer of another implementation or an
attacker would (refused at the commit, and by the memory-only choice, ``commit.held_whole``).
Each is one CheckpointError, no ``commit.json``, nothing of the step deleted. Before: ``c/<P>/0``
(P = 2**61 - 1) and ``c/1`` added up as ``c/1/0`` (the digest took any coordinate, and no
arity); keys outside the grid or of another array, a key named twice in one record, and a
record the tree does not count were all accepted once the digests differed. Two ranks naming
the same shard is no attack: ranks that hold one slice (a 2-D mesh's replicas) each write it.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from ckptd import catalog, claims, commit, donetree, pins
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import open_store
from tests.protocol.parts import SHARDS, memory_only, pinned_record, write_part

W = mf.array_path("w")
NOT_A_KEY = "not a shard key as grids spell them"
MISSING = "no rank wrote 1 shard objects the manifest needs, e.g. arrays/w/c/1/0"


def odd(key):
    return f"shard keys not in the manifest, e.g. {key}"


@pytest.fixture(params=["local", "moto"])
def root(request, tmp_path):
    uri = str(tmp_path / "root") if request.param == "local" else request.getfixturevalue("s3_bucket")
    with open_store(uri) as store:
        yield store


def _keys(store, step):
    return {i.key for i in store.list(f"{mf.step_dir(step)}/")}


def _refused(store, step, match, call):
    """``call()`` raises one CheckpointError matching ``match``; no commit.json, nothing deleted."""
    before = _keys(store, step)
    with pytest.raises(CheckpointError, match=match):
        call()
    assert catalog.read_commit(store, step) is None
    assert before <= _keys(store, step)


def _half_saved(store, step, attempt="att"):
    """Ranks 0 and 1 of a world of 2 wrote their shards (c/0/0, c/1/0), rank 0 the manifest; rank
    0 finished through the live path (the tree waits for rank 1)."""
    write_part(store, step, attempt, 0, 2, SHARDS[:1])
    write_part(store, step, attempt, 1, 2, SHARDS[1:])
    assert not commit.finish_rank(store, step, attempt, 0, 2, pinned_record(store, step, 0, SHARDS[:1]))


def _put_record(store, step, rank, rec, attempt="att"):
    """``rec`` straight into the done tree under the name its contents add up to."""
    key = donetree.record_key(step, attempt, rank, rec)
    store.put(key, json.dumps({**rec, "shard_digest": donetree.DIGEST_VERSION}).encode())
    return key


P = donetree.P
# rank 1's shard keys; where the live path refuses them ("write": write_done, else the commit's
# message); the commit's message when the record is written directly
ATTACKS = {
    "leading zero": ([f"{W}/c/01/0"], NOT_A_KEY, MISSING),
    "negative": ([SHARDS[1], f"{W}/c/-1/0"], NOT_A_KEY, odd(f"{W}/c/-1/0")),
    "signed": ([f"{W}/c/+1/0"], NOT_A_KEY, MISSING),
    "huge, aliasing c/1/0": ([f"{W}/c/{P}/0"], NOT_A_KEY, MISSING),
    "2**24": ([SHARDS[1], f"{W}/c/{1 << 24}/0"], NOT_A_KEY, odd(f"{W}/c/{1 << 24}/0")),
    "outside the grid": ([SHARDS[1], f"{W}/c/2/0"], odd(f"{W}/c/2/0"), odd(f"{W}/c/2/0")),
    "wrong arity, aliasing c/1/0": ([f"{W}/c/1"], MISSING, MISSING),
    "two arities": ([SHARDS[1], f"{W}/c/0"], NOT_A_KEY, odd(f"{W}/c/0")),
    "another array": ([SHARDS[1], "arrays/v/c/0/0"], odd("arrays/v/c/0/0"), odd("arrays/v/c/0/0")),
    "not a shard": ([SHARDS[1], f"{W}/unused"], NOT_A_KEY, odd(f"{W}/unused")),
    "named twice": ([SHARDS[1], SHARDS[1]], "names a shard key more than once", "names a shard key more than once"),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_bad_shard_key_is_refused_on_the_live_path(root, attack):
    names, live, _ = ATTACKS[attack]
    _half_saved(root, 1)
    rec = pinned_record(root, 1, 1, SHARDS[1:], names)
    _refused(root, 1, live, lambda: commit.finish_rank(root, 1, "att", 1, 2, rec))


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_bad_shard_key_written_directly_is_not_committed(root, attack):
    names, _, direct = ATTACKS[attack]
    _half_saved(root, 2)
    _put_record(root, 2, 1, pinned_record(root, 2, 1, SHARDS[1:], names))
    _refused(root, 2, direct, lambda: commit.climb(root, 2, "att", 1, 2))
    _refused(root, 2, direct, lambda: memory_only(root, 2))


def test_ranks_that_hold_one_slice_each_name_it_and_commit(root):
    """Both ranks wrote and named both shards, as the ranks of a 2-D mesh that hold the same
    slice do: the digests differ (each shard counted twice), the records are read, every shard
    is named and none is foreign, so the step commits (and the memory-only choice takes it)."""
    write_part(root, 3, "att", 0, 2, SHARDS)
    write_part(root, 3, "att", 1, 2, SHARDS)
    assert not commit.finish_rank(root, 3, "att", 0, 2, pinned_record(root, 3, 0, SHARDS))
    assert commit.finish_rank(root, 3, "att", 1, 2, pinned_record(root, 3, 1, SHARDS))
    assert catalog.read_commit(root, 3)["attempt"] == "att"
    assert memory_only(root, 3)["attempt"] == "att"


@pytest.mark.parametrize(
    "planted,deeper", [(2, False), (1, False), (1, True)], ids=["rank beyond the world", "second record", "deeper"]
)
def test_a_record_the_tree_does_not_count_is_not_read(root, planted, deeper):
    """Rank 1 finished naming no shard; a record naming c/1/0 planted under rank 2 (the world
    has 2), as rank 1's second record (listed after its first) or one folder below rank 1's is
    not one the tree counted, so the commit does not read it either."""
    _half_saved(root, 4)
    key = _put_record(root, 4, planted, pinned_record(root, 4, 1, SHARDS[1:]))
    if deeper:
        where, _, name = key.rpartition("/")
        root.put(f"{where}/x/{name}", root.get(key))
        root.delete(key)
    rec = pinned_record(root, 4, 1, [], [])
    _refused(root, 4, MISSING, lambda: commit.finish_rank(root, 4, "att", 1, 2, rec))
    _refused(root, 4, MISSING, lambda: memory_only(root, 4))


def test_a_done_record_of_another_attempt_does_not_add_up(root):
    """Rank 1 of attempt "old" finished; the job's next attempt "new" took the step over, and
    its rank 1 never finished. A copy of old's record put into new's tree (its name and bytes
    as they were) completes the tree, but is refused: it adds up only for "old"."""
    write_part(root, 5, "old", 0, 2, SHARDS)
    assert not commit.finish_rank(root, 5, "old", 1, 2, pinned_record(root, 5, 1, SHARDS[1:]))
    (old,) = [i.key for i in root.list(donetree.folder(5, "old", 1, 0))]
    copied = root.get(old)
    claims.begin(root, 5, "new", "job-a")  # the takeover clears what "old" wrote
    write_part(root, 5, "new", 0, 2, SHARDS)
    root.put(old.replace(f"/{mf.DONE}/old/", f"/{mf.DONE}/new/"), copied)
    rec = pinned_record(root, 5, 0, SHARDS[:1])
    match = "does not add up to its name for this attempt$"
    _refused(root, 5, match, lambda: commit.finish_rank(root, 5, "new", 0, 2, rec))
    _refused(root, 5, match, lambda: memory_only(root, 5, "new"))


def _old_digest(keys, step, attempt):
    """The shard digest before it was keyed by arity (records without ``shard_digest``)."""
    total = 0
    for key in keys:
        path, _, tail = key.rpartition("/c/")
        h = 1 + int.from_bytes(hashlib.sha256(json.dumps([step, attempt, path]).encode()).digest()[:8], "big") % (P - 1)
        for d, c in enumerate(map(int, tail.split("/"))):
            h = h * pow(donetree._base(d), c, P) % P
        total += h
    return total % P


def test_a_step_half_saved_across_the_digest_change_is_refused(root):
    """Rank 1 wrote its record with the previous ckptd (its name carries the old digest), rank
    0 with this one: one clear error, saying to save the step again."""
    _half_saved(root, 6)
    rec = pinned_record(root, 6, 1, SHARDS[1:])
    t = donetree.record_totals(rec, 6, "att")
    old = donetree.Totals(t.bytes, t.objects, _old_digest(SHARDS[1:], 6, "att"), t.pins)
    key = donetree.folder(6, "att", 1, 0) + donetree._name("r", 1, old)
    root.put(key, json.dumps(rec).encode())
    match = "does not add up to its name for this attempt \\(written by a ckptd with another shard digest"
    _refused(root, 6, match, lambda: commit.climb(root, 6, "att", 1, 2))
    _refused(root, 6, match, lambda: memory_only(root, 6))


def test_well_named_records_commit(root):
    """The valid case: each rank names the shard it wrote; the step commits, verifies, and the
    memory-only choice takes it."""
    _half_saved(root, 7)
    assert commit.finish_rank(root, 7, "att", 1, 2, pinned_record(root, 7, 1, SHARDS[1:]))
    rec = catalog.read_commit(root, 7)
    assert rec["attempt"] == "att" and rec["world_size"] == 2
    assert commit.check_consistency(root, 7, catalog.load_manifest(root, 7)) == []
    assert set(pins.committed(root, 7).shards) == set(SHARDS)
    assert memory_only(root, 7)["attempt"] == "att"
