"""Retention: which checkpoints of a job root are deleted, and the sweep after a commit.

Invariant: retention never deletes the newest committed step, the newest step ``ckptd verify``
passed, a step being written (``protect``), or any step newer than the newest commit; a
checkpoint is deleted commit record first (``catalog.delete_checkpoint``), so a half-deleted one
reads as partial. Its failure never fails the save that triggered it.

Who applies it: the writer that wrote the commit record (:func:`after_commit`: the in-process
writer, the ``ckptd serve`` daemon, ``benchmarks.scale``), the trainer's rank 0
(``Checkpointer``: :func:`apply_retention` on its own thread) and ``ckptd gc``
(:func:`select_for_deletion`, :func:`retain`). The call sequence after a commit::

    1. after_commit(store, result, keep_last)   only where result.committed_here, after the
                                                result is reported (never delays the save)
    2.   sweep_leftovers(store, step, before)   incomplete writes older than the save
    3.   apply_retention(store, keep_last)      retain(): select_for_deletion(), then
                                                catalog.delete_checkpoint() of each

This module holds the selection (it reads ``ckptd verify``'s records) so that ``catalog``, which
every reader imports, imports neither ``verify`` nor the commit protocol.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.verify import read_record
from storage_backends import StorageError, Store

if TYPE_CHECKING:
    from ckptd.persist import SaveResult

log = logging.getLogger("ckptd.retention")


def after_commit(store: Store, result: SaveResult, keep_last: int | None) -> None:
    """Retention by the writer that wrote the commit record (the in-process writer, the daemon's
    committing worker), after it has reported the commit (so retention delays neither the
    caller nor the result). With a daemon, the trainer's rank 0 also applies its own
    ``keep_last`` (:func:`apply_retention`); both only delete what :func:`select_for_deletion`
    selects, so applying it twice is harmless.

    It first sweeps the committed step for incomplete writes older than this save: once the
    commit record exists every rank's data is durable, so a temp file (filesystem) or an open
    multipart upload (S3) that predates this rank's save can only be an earlier, killed attempt's,
    which the fenced ``begin`` does not purge (other ranks may already be writing when a rank takes
    a step over). Younger ones are left alone: another rank may be inside its losing
    ``put_if_absent`` of ``commit.json`` right now."""
    if not result.committed_here:
        return
    if result.started_at is not None:
        sweep_leftovers(store, result.step, before=result.started_at)
    if keep_last:
        apply_retention(store, keep_last)


def sweep_leftovers(store: Store, step: int, before: float) -> None:
    """Remove the incomplete writes left in committed ``step`` that started before the wall-clock
    time ``before``; best effort, logged."""
    try:
        gone = store.abort_stale_uploads(max(0.0, time.time() - before), prefix=f"{mf.step_dir(step)}/")
    except StorageError as e:
        log.warning("could not sweep incomplete writes of step %d: %s", step, e)
        return
    if gone:
        log.info("removed %d incomplete writes a killed attempt left in step %d", len(gone), step)


def apply_retention(store: Store, keep_last: int) -> None:
    """Retention after a commit; its failure never fails the save that triggered it."""
    try:
        deleted = retain(store, keep_last)
        if deleted:
            log.info("retention removed steps %s", deleted)
    except (CheckpointError, StorageError) as e:
        log.warning("retention failed: %s", e)


# ------------------------------------------------------------------------------ selection


def select_for_deletion(store: Store, keep_last: int, protect: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The steps ``retain`` would delete, ascending; deletes nothing (``ckptd gc --dry-run``).

    Keeps the newest ``keep_last`` committed checkpoints; selects older committed ones, and
    partial ones older than the newest commit (they can no longer complete: one save is in
    flight per job and a newer one committed). Never selects the newest committed step, the newest
    step ``ckptd verify`` passed (see ``newest_verified``), a step in ``protect`` (being
    written), or any step newer than the newest commit."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    all_steps = catalog.steps(store)
    committed = [s for s in all_steps if store.exists(f"{mf.step_dir(s)}/{mf.COMMIT}")]
    if not committed:
        return []
    keep = set(committed[-keep_last:]) | set(protect)
    verified = newest_verified(store, committed)
    if verified is not None:
        keep.add(verified)
    newest = committed[-1]
    return [s for s in all_steps if s < newest and s not in keep]


def newest_verified(store: Store, committed: list[int]) -> int | None:
    """The newest of ``committed`` whose ``ckptd verify`` record says it passed, or None.

    Retention keeps it whatever ``keep_last`` says: when newer checkpoints turn out corrupt it
    is the one to fall back to, and it must not be deleted in favour of a newer bad one. Costs
    one GET per committed step newer than it (retention keeps those few)."""
    for s in reversed(committed):
        rec = read_record(store, s)
        if rec is not None and rec["ok"]:
            return s
    return None


def retain(store: Store, keep_last: int, protect: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Apply retention: delete what :func:`select_for_deletion` selects. Returns deleted steps."""
    doomed = select_for_deletion(store, keep_last, protect)
    for s in doomed:
        catalog.delete_checkpoint(store, s)
    return doomed


__all__ = ["after_commit", "apply_retention", "newest_verified", "retain", "select_for_deletion", "sweep_leftovers"]
