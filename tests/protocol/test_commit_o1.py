"""The commit's shard check is O(arrays), not O(arrays x shards) (issue 31 item 2).

The root compares the done tree's shard digest with the manifest's, which
``commit.expected_digest`` computes per array in closed form (``donetree.grid_digest``): the
commit of a manifest whose arrays have many shards never enumerates a shard grid. Only a
mismatch lists the shards, to say which is missing (the guarantee of the commit rules).
"""

from __future__ import annotations

import pytest

from ckptd import catalog, claims, codec, commit, donetree, persist
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout
from ckptd.errors import CheckpointError
from storage_backends.memory import MemoryStore

ARRAYS, SHARDS, RANKS = 48, 1024, 4


def layouts():
    return {
        f"a{i}": ArrayLayout((SHARDS * 2, 4 + i % 3), "float32", (2, 4 + i % 3), (2, 4 + i % 3)) for i in range(ARRAYS)
    }


@pytest.fixture
def counted(monkeypatch):
    """How many times a shard grid is enumerated (the real ``shard_coords`` runs; it is counted)."""
    calls = []
    real = codec.ArrayLayout.shard_coords

    def shard_coords(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(codec.ArrayLayout, "shard_coords", shard_coords)
    return calls


def save(store, step, drop=None):
    """A step of ARRAYS x SHARDS shards written by RANKS ranks (rank r: shards i % RANKS == r);
    ``drop``: a shard key no rank names. True if the last rank committed."""
    lays = layouts()
    attempt = f"a{step}"
    claims.begin(store, step, attempt, "job")
    m = mf.Manifest(step, RANKS, {k: mf.TensorEntry(k, lay) for k, lay in lays.items()}, {}, attempt)
    for key, data in persist.manifest_objects(m):
        store.put(f"{mf.step_dir(step)}/{key}", data)
    committed = False
    for r in range(RANKS):
        shards = [
            f"{mf.array_path(k)}/{lay.shard_key((i, 0))}" for k, lay in lays.items() for i in range(r, SHARDS, RANKS)
        ]
        shards = [s for s in shards if s != drop]
        rec = {"rank": r, "writer": "job", "bytes": 0, "objects": len(shards), "shards": shards}
        committed = commit.finish_rank(store, step, attempt, r, RANKS, rec)
    return committed


def test_the_commit_enumerates_no_shard_grid(counted):
    store = MemoryStore("memory://o1")
    before = len(counted)
    assert save(store, 1)
    assert len(counted) == before  # 48 x 1024 shards committed, no grid walked
    assert catalog.read_commit(store, 1)["attempt"] == "a1"


def test_a_missing_shard_is_still_refused_and_named(counted):
    store = MemoryStore("memory://o1-missing")
    missing = f"{mf.array_path('a7')}/c/513/0"
    with pytest.raises(
        CheckpointError, match="no rank wrote 1 shard objects the manifest needs, e.g. arrays/a7/c/513/0"
    ):
        save(store, 2, drop=missing)
    assert counted  # the mismatch listed the shards to name the missing one
    assert catalog.read_commit(store, 2) is None


@pytest.mark.parametrize(
    "shape,shard",
    [((), ()), ((5,), (2,)), ((7, 3), (2, 2)), ((4, 5, 6), (3, 2, 4)), ((1 << 12, 8), (1, 8))],
)
def test_the_closed_form_equals_the_sum_over_every_shard(shape, shard):
    lay = ArrayLayout(shape, "float32", shard, shard)
    keys = [f"arrays/x/{lay.shard_key(c)}" for c in lay.shard_coords()]
    assert donetree.grid_digest("arrays/x", lay.grid_shape, 1, "a") == donetree.shard_digest(keys, 1, "a")
    m = mf.Manifest(1, 1, {"x": mf.TensorEntry("x", lay)}, {}, "a")
    assert commit.expected_digest(m) == donetree.shard_digest(commit.expected_shards(m), 1, "a")
    assert donetree.shard_digest(keys[1:] + keys[:1], 1, "a") == donetree.shard_digest(keys, 1, "a")
    if len(keys) > 1:  # a shard named twice in place of another is a different sum
        assert donetree.shard_digest([keys[0], *keys[:-1]], 1, "a") != donetree.shard_digest(keys, 1, "a")
    # keyed: the same keys of another attempt or step are another sum
    assert donetree.shard_digest(keys, 1, "b") != donetree.shard_digest(keys, 1, "a")
    assert donetree.shard_digest(keys, 2, "a") != donetree.shard_digest(keys, 1, "a")
