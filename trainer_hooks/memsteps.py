"""Frequent memory-only checkpoints (``Checkpointer(..., daemon=URL, persist_every=K)``): which
saves persist, and restoring the newest step the surviving daemons hold whole. What such a step
guarantees, and why a restore never mixes two attempts nor picks an abandoned future:
docs/reliability.md, "Memory-only steps".

Save: a step divisible by ``persist_every`` persists to the job root as always; any other step
is memory-only (``ckptd.server.tiers``): every rank asks its node's daemon to reserve room
for its part (``POST /v1/tiers/reserve``) and the ranks agree (one ``all_max``): if any
daemon has no room, every rank persists the step instead (one WARNING on rank 0, and
``ckptd_tier_persisted_instead_total`` on the daemon that said no), so a memory-only save
is never silently lost and never half in memory, half in the root.

Restore (``choose``, rank 0, the first candidate of ``restore.restore`` with no step asked):
with ``--ec`` rank 0's daemon first rebuilds what lost daemons of its group held
(``ckptd.server.parity``); then newest first, a (step, attempt) newer than the newest committed
step counts only when what the daemons hold passes ``commit.held_whole`` (its manifest, every
rank's done record of that attempt, every object they pin at the pinned size, and the root's
commit rule ``commit.whole_step``).
Every rank then reads it over a ``tiered.TierSource`` with no job root behind it, its commit
record the one ``commit.whole_step`` returns. If none counts, or its restore fails on any rank,
the committed steps follow; after any restore of step S, each rank's daemon drops memory-only
steps newer than S and tells its peers to (``TieredRestore.fence``).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptd.commit import newest_held
from ckptd.errors import CheckpointError
from trainer_hooks.tiered import TierSource

__all__ = ["choose", "memory_only_save", "reserve_bytes"]

log = logging.getLogger("ckptd.memsteps")


# ------------------------------------------------------------------------------------ save


def reserve_bytes(job) -> int:
    """An upper bound of the bytes rank's part of a step holds in a daemon's memory: its shard
    objects (images with their checksums; a shard without one gains 4 bytes per chunk), its
    metadata and its done record."""
    total = 0
    for s in job.shards:
        t = s.image if s.image is not None else s.buffer
        total += t.numel() * t.element_size() + 4 * max(1, s.buffer.shape[0] if s.buffer.dim() else 1) + 64
    total += sum(len(b) for _, b in job.metadata)
    return total + (1 << 20) + len(job.shards) * 256  # done record: a pin per shard, and room


def memory_only_save(sink, coord, step: int, attempt: str, job, persist_every: int) -> bool:
    """Whether ``step`` is saved memory-only: not a multiple of ``persist_every``, and every
    rank's daemon reserved room for its part. Collective (one ``all_max``)."""
    if persist_every <= 1 or step % persist_every == 0:
        return False
    try:
        # objects: one per shard and per metadata object, the done record (and room)
        ok = sink.reserve_memory(step, attempt, reserve_bytes(job), len(job.shards) + len(job.metadata) + 4)
    except CheckpointError as e:
        log.warning("rank %d: cannot reserve room for memory-only step %d: %s", coord.rank, step, e)
        ok = False
    refused = coord.all_max([0 if ok else 1])[0]
    if refused and coord.rank == 0:
        log.warning(
            "step %d was to be memory-only but a daemon has no room for it (its staging budget, or the "
            "descriptors and mappings its memory tier may use): "
            "persisting it to the job root instead",
            step,
        )
    return not refused


# ------------------------------------------------------------------------------ choosing


def choose(tiers, newest_persisted: int | None) -> Any:
    """Rank 0: (the newest memory-only step newer than ``newest_persisted`` that the surviving
    tiers hold whole (``commit.newest_held``, the rule the status page names too), as ``(step,
    attempt, holders, commit, data paths)``, or None)."""
    tiers.rebuild()  # --ec: the parts of lost daemons, rebuilt from their group's parity first
    held, data, _, _ = tiers.walk([tiers.daemon_url])
    got, skipped = newest_held(held, newest_persisted, lambda s, a: TierSource(tiers, s, a, held[(s, a)], data))
    for step, attempt, why in skipped:
        log.info("memory-only step %d (attempt %s) is not held whole: %s", step, attempt, why)
    return None if got is None else (got[0], got[1], held[got[:2]], got[2], data)
