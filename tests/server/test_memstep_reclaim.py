"""What a save that needs staging memory takes from the memory tier (``Tiers._reclaim``), with
the tier's real table and the daemon's real staging budget in this process: memory-only parts of
a step older than the newest step held whole go first (before a hot copy), and the parts of the
newest step held whole go last (after every hot copy). Memory-only parts are written the way the
daemon writes them: into ``Tiers.holder``'s store, then ``Tiers.held``."""

from __future__ import annotations

import hashlib
import json

from ckptd import donetree
from ckptd import manifest as mf
from ckptd.server.staging import Staging
from ckptd.server.tiers import Tiers

ROOT, HOT_ROOT = "file:///job", "file:///other"
PART = 4000  # bytes of each rank's data object


def _hold(tiers: Tiers, step: int, rank: int, world: int) -> None:
    """Rank's part of memory-only ``step`` (attempt ``a<step>``) of a ``world``-rank job: its data,
    rank 0's manifest (no tensors: the done records need name no shard), its done record (rank
    0's pins the manifest)."""
    attempt, folder = f"a{step}", mf.step_dir(step)
    store = tiers.holder(ROOT, step, attempt, rank)
    store.put(f"{folder}/state/r{rank}", b"x" * PART)
    pins: dict = {"shards": {}, "meta": {}}
    if rank == 0:
        m = mf.Manifest(step=step, world_size=world, tensors={}, state={}, attempt=attempt)
        store.put(f"{folder}/{mf.MANIFEST}", m.to_bytes())
        pins["meta"][mf.MANIFEST] = hashlib.sha256(m.to_bytes()).hexdigest()  # the writer pins it
    record = {"bytes": PART, "objects": 1, "shards": [], "pins": pins}
    store.put(donetree.record_key(step, attempt, rank, record), json.dumps(record).encode())
    tiers.held(ROOT, step, attempt, rank)


def _ranks(tiers: Tiers, step: int) -> set[int]:
    return {p["rank"] for p in tiers.describe(ROOT)["memory_only"] if p["step"] == step}


def test_a_save_takes_parts_that_can_no_longer_be_restored_first_and_the_whole_step_last(tmp_path):
    staging = Staging(tmp_path / "staging", budget=40_000)
    leases = []
    try:
        tiers = Tiers(staging, [], None, 0, None)  # no ring: a part needs no push to count
        tee = tiers.recorder(HOT_ROOT, 10, "h", 0)  # a hot copy of another root's committed step
        tee("step_0000000010/arrays/w/c/0", b"h" * PART)
        tiers.committed(HOT_ROOT, 10, "h")
        _hold(tiers, 2, 0, 2)  # step 2: rank 0 only, never completed (its node died)
        _hold(tiers, 3, 0, 2)  # step 3: both ranks, whole here
        _hold(tiers, 3, 1, 2)
        assert (_ranks(tiers, 2), _ranks(tiers, 3)) == ({0}, {0, 1})

        def save(nbytes: int) -> None:  # a lease that needs ``nbytes`` more than the budget has free
            free = staging.budget - staging.staged_bytes - staging.reserved_bytes
            leases.append(staging.create(ROOT, 0, free + nbytes, free + nbytes, f"client-{len(leases)}"))

        save(1)  # step 2 can no longer be the step restored: its part goes before the hot copy
        assert _ranks(tiers, 2) == set() and tiers.keys(HOT_ROOT, 10, "h") != []
        save(1)  # then the hot copy, before any part of the newest whole step
        assert tiers.keys(HOT_ROOT, 10, "h") == [] and _ranks(tiers, 3) == {0, 1}
        save(1)  # nothing else is left: a save still beats a copy
        assert len(_ranks(tiers, 3)) == 1
    finally:
        for lease in leases:
            staging.release(lease.id)
        staging.close()
