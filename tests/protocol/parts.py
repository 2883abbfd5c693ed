"""What a rank writes on the live save path, piece by piece, for the protocol tests: the claim,
its shards, rank 0's manifest (:func:`write_part`), then its done record and the climb of the
done tree (:func:`finish`, ``commit.finish_rank``)."""

from __future__ import annotations

import numpy as np

from ckptd import claims, commit, donetree, persist
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, encode_shard
from storage_backends import StorageError, memory

__all__ = [
    "ClaimReadsFail",
    "LAYOUT",
    "SHARDS",
    "committed_step",
    "finish",
    "memory_only",
    "pinned_record",
    "save_part",
    "write_part",
]

LAYOUT = ArrayLayout((4, 2), "float32", (2, 2), (2, 2))  # two shards
SHARDS = [f"{mf.array_path('w')}/{LAYOUT.shard_key((i, 0))}" for i in range(2)]


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


def pinned_record(store, step, rank, shards, names=None, writer="job-a"):
    """Rank's done record as ``persist`` makes it: naming ``names`` (default ``shards``),
    pinning the ``shards`` it wrote (their sizes as stored; rank 0 also the manifest), its
    time ``1000 + rank``."""
    folder = mf.step_dir(step)
    meta = {mf.MANIFEST: store.get(f"{folder}/{mf.MANIFEST}")} if rank == 0 else {}
    pins = donetree.make_pins({k: (len(store.get(f"{folder}/{k}")), b"") for k in shards}, meta)
    names = list(shards if names is None else names)
    rec = {"rank": rank, "writer": writer, "bytes": 16, "objects": 1, "shards": names, "pins": pins}
    return {**rec, "time": 1000.0 + rank}


def memory_only(store, step, attempt="att"):
    """The memory-only choice over the step's parts as the tiers would hold them (every object
    of the step but its claims and commit.json): ``commit.held_whole``'s commit record."""
    from ckptd.commit import held_whole

    held = memory.MemoryStore()
    for info in store.list(f"{mf.step_dir(step)}/"):
        if not info.key.endswith(f"/{mf.COMMIT}") and f"/{mf.CLAIMS}/" not in info.key:
            held.put(info.key, store.get(info.key))
    holders = {i.key: (len(held.get(i.key)), ["tier"]) for i in held.list("")}
    return held_whole(held, step, attempt, holders)


def save_part(store, step, attempt, rank, world_size, shards, writer="job-a", manifest=None):
    write_part(store, step, attempt, rank, world_size, shards, writer, manifest)
    return finish(store, step, attempt, rank, world_size, shards, writer)


def committed_step(store, step, attempt="a0"):
    assert save_part(store, step, attempt, 0, 1, SHARDS)


class ClaimReadsFail(memory.MemoryStore):
    """A store whose GETs of claim records fail (as S3 answers SlowDown after every retry)."""

    def get(self, key, limit=None):
        if "/_claims/" in key:
            raise StorageError(f"{self.uri}: 503 SlowDown for {key}")
        return super().get(key, limit)
