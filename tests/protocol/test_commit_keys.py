"""The commit's shard check names keys: a done record's shard keys are spelled as their grid
spells them, and the shard digest is keyed by the step and the attempt.

Each attack is performed for real on a local root and on a moto S3 root, through the live
write path (``commit.finish_rank``) or by writing the record directly, as a writer of another
implementation or an attacker would; the memory-only choice (``commit.held_whole``) is given
the same part set and refuses it too. Before, the digest was an unkeyed sum over parsed keys:
``c/01/0`` added up as ``c/1/0``, and a record copied from another attempt added up as well.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckptd import catalog, claims, commit, donetree
from ckptd import manifest as mf
from ckptd.codec import encode_shard
from ckptd.errors import CheckpointError
from storage_backends import open_store
from tests.protocol.parts import LAYOUT, SHARDS, memory_only, pinned_record, write_part

MISSPELLED = f"{mf.array_path('w')}/c/01/0"  # the grid spells it c/1/0 (SHARDS[1])


@pytest.fixture(params=["local", "moto"])
def root(request, tmp_path):
    uri = str(tmp_path / "root") if request.param == "local" else request.getfixturevalue("s3_bucket")
    with open_store(uri) as store:
        yield store


def _misspelled_part(store, step):
    """Rank 0 writes shard c/0/0 and the manifest and finishes; rank 1 writes its shard under
    the misspelled key. Returns rank 1's done record, naming (and pinning) what it wrote."""
    write_part(store, step, "att", 0, 2, SHARDS[:1])
    assert not commit.finish_rank(store, step, "att", 0, 2, pinned_record(store, step, 0, SHARDS[:1]))
    block = np.full((2, 2), 11, dtype=np.float32)
    store.put(f"{mf.step_dir(step)}/{MISSPELLED}", encode_shard(LAYOUT, (1, 0), block))
    return pinned_record(store, step, 1, [MISSPELLED])


def test_a_misspelled_shard_key_is_refused_when_the_record_is_written(root):
    rec = _misspelled_part(root, 1)
    with pytest.raises(CheckpointError, match="names shard 'arrays/w/c/01/0', which its grid spells 'arrays/w/c/1/0'"):
        commit.finish_rank(root, 1, "att", 1, 2, rec)
    assert donetree.reported_ranks(root, 1, "att") == {0}  # not written
    assert catalog.read_commit(root, 1) is None


def test_a_misspelled_record_written_directly_is_not_committed(root):
    rec = _misspelled_part(root, 2)
    root.put(donetree.record_key(2, "att", 1, rec), json.dumps(rec).encode())
    with pytest.raises(CheckpointError, match="no rank wrote 1 shard objects the manifest needs, e.g. arrays/w/c/1/0"):
        commit.climb(root, 2, "att", 1, 2)
    assert catalog.read_commit(root, 2) is None
    with pytest.raises(CheckpointError, match="e.g. arrays/w/c/1/0"):
        memory_only(root, 2)


def test_a_done_record_of_another_attempt_does_not_add_up(root):
    """Rank 1 of attempt "old" finished; the job's next attempt "new" took the step over, and
    its rank 1 never finished. A copy of old's record put into new's tree (its name and bytes
    as they were) completes the tree, but is refused: it adds up only for "old"."""
    write_part(root, 3, "old", 0, 2, SHARDS)
    assert not commit.finish_rank(root, 3, "old", 1, 2, pinned_record(root, 3, 1, SHARDS[1:]))
    (old,) = [i.key for i in root.list(donetree.folder(3, "old", 1, 0))]
    copied = root.get(old)
    claims.begin(root, 3, "new", "job-a")  # the takeover clears what "old" wrote
    write_part(root, 3, "new", 0, 2, SHARDS)
    root.put(old.replace(f"/{mf.DONE}/old/", f"/{mf.DONE}/new/"), copied)
    with pytest.raises(CheckpointError, match="does not add up to its name for this attempt"):
        commit.finish_rank(root, 3, "new", 0, 2, pinned_record(root, 3, 0, SHARDS[:1]))
    assert catalog.read_commit(root, 3) is None
    with pytest.raises(CheckpointError, match="does not add up to its name for this attempt"):
        memory_only(root, 3, "new")
