"""Retention: which checkpoints of a job root are deleted, and the sweep after a commit.

Invariant: retention never deletes the newest committed step, the newest step that passes
:func:`check_restorable` (so a root always keeps a step that restores as far as a cheap check can
tell, with or without ``ckptd verify``), the newest such step ``ckptd verify`` did not record bad,
the newest step it recorded ok, a step being written (``protect``), any step newer than the newest
commit, or a step that jumped more than ``max_step_jump`` past the committed step before it
(kept, and not counted among the newest ``keep_last``: a step number out of nowhere never pushes
real steps out). Verify records only ever add to what is kept, so a forged one cannot make
retention delete what it would keep without one. A checkpoint is deleted commit record first
(``catalog.delete_checkpoint``), so a half-deleted one reads as partial. Its failure never fails
the save that triggered it.

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
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.verify import read_record
from storage_backends import StorageError, Store

if TYPE_CHECKING:
    from ckptd.persist import SaveResult

log = logging.getLogger("ckptd.retention")


def after_commit(store: Store, result: SaveResult, keep_last: int | None, max_step_jump: int | None = -1) -> None:
    """Retention by the writer that wrote the commit record, once it has reported the commit.
    With a daemon, the trainer's rank 0 also applies its own ``keep_last``: both only delete
    what :func:`select_for_deletion` selects, so applying it twice is harmless.

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
        apply_retention(store, keep_last, max_step_jump)


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


def apply_retention(store: Store, keep_last: int, max_step_jump: int | None = -1) -> None:
    """Retention after a commit; its failure never fails the save that triggered it.
    ``max_step_jump``: -1 for :func:`max_step_jump_default`, None for no bound."""
    try:
        if max_step_jump == -1:
            max_step_jump = max_step_jump_default()
        if deleted := retain(store, keep_last, max_step_jump=max_step_jump):
            log.info("retention removed steps %s", deleted)
    except (CheckpointError, StorageError) as e:
        log.warning("retention failed: %s", e)


DEFAULT_MAX_STEP_JUMP = 1_000_000


def max_step_jump_default() -> int | None:
    """``CKPTD_MAX_STEP_JUMP`` (0: no bound) else :data:`DEFAULT_MAX_STEP_JUMP`."""
    raw = os.environ.get("CKPTD_MAX_STEP_JUMP", "").strip()
    if not raw:
        return DEFAULT_MAX_STEP_JUMP
    if not raw.isascii() or not raw.isdigit() or len(raw) > 10:
        raise CheckpointError(f"CKPTD_MAX_STEP_JUMP={raw[:40]!r}: expected a whole number of steps (0: no bound)")
    return int(raw) or None


def check_step_jump(store: Store, step: int, max_jump: int | None) -> None:
    """Refuse to write ``step`` when it lies more than ``max_jump`` steps past the job's newest
    committed step (a typo, or a forged hand-off of step 9999999999 that retention would then
    count as the newest and delete every other step for). No bound when ``max_jump`` is None or
    the root has no commit."""
    if not max_jump:
        return
    newest = catalog.latest_step(store)
    if newest is not None and step > newest + max_jump:
        raise CheckpointError(
            f"{catalog.where(store, step)}: step {step} is {step - newest} steps past the newest committed step "
            f"{newest}, more than max_step_jump={max_jump}; refusing it (raise max_step_jump, or "
            "CKPTD_MAX_STEP_JUMP, if the job really numbers its steps that way)"
        )


def trusted_steps(committed: list[int], max_jump: int | None) -> tuple[list[int], list[int]]:
    """Split ascending ``committed`` at the first step more than ``max_jump`` past the one
    before it: (the steps retention counts, the steps that appeared out of nowhere)."""
    jumps = (i for i in range(1, len(committed)) if max_jump and committed[i] - committed[i - 1] > max_jump)
    cut = next(jumps, len(committed))
    return committed[:cut], committed[cut:]


def check_restorable(store: Store, step: int) -> str | None:
    """Cheap check that a committed step can be restored: None if it passes, else why not.

    Reads the commit record and the manifest and lists the step's objects, no chunk: every shard
    object a restore reads exists with the exact size its layout implies. It catches lost,
    truncated and cut objects; a flipped byte or a bad ``zarr.json`` needs ``ckptd verify``."""
    where = catalog.where(store, step)
    try:
        if catalog.read_commit(store, step) is None:
            return "no commit record"
        m = catalog.load_manifest(store, step)
        prefix = mf.step_dir(step)
        sizes = {o.key: o.size for o in store.list(f"{prefix}/{mf.ARRAYS}/")}
    except (CheckpointError, StorageError, ValueError) as e:
        return str(e)
    for entry in m.tensors.values():
        layout = entry.layout
        if layout.nbytes == 0 or entry.value is not None:
            continue
        for coord in layout.shard_coords():
            name = f"array {entry.path!r} shard {layout.shard_key(coord)}"
            got, want = sizes.get(f"{prefix}/{entry.path}/{layout.shard_key(coord)}"), layout.object_nbytes(coord)
            if got is None:
                return f"{where}: {name}: missing"
            if got != want:
                return f"{where}: {name}: {got} bytes, the layout implies {want}"
    return None


@dataclass
class Plan:
    """What retention keeps and deletes, and why (``ckptd gc`` prints it)."""

    doomed: list[int] = field(default_factory=list)
    restorable: int | None = None  # newest committed step that passes check_restorable
    failed: dict[int, str] = field(default_factory=dict)  # newer committed steps that did not, why
    out_of_nowhere: list[int] = field(default_factory=list)


def plan(
    store: Store,
    keep_last: int,
    protect: set[int] | frozenset[int] = frozenset(),
    max_step_jump: int | None = DEFAULT_MAX_STEP_JUMP,
) -> Plan:
    """The retention plan; deletes nothing (``ckptd gc --dry-run``).

    Keeps the newest ``keep_last`` committed checkpoints, counted among the steps that did not
    jump more than ``max_step_jump`` past the committed step before them (those that did are kept
    and ignored); selects older committed ones, and partial ones older than the newest commit
    (they can no longer complete: one save is in flight per job and a newer one committed).
    Never selects what the module docstring's invariant keeps (``protect``: steps being written)."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    out = Plan()
    all_steps = catalog.steps(store)
    committed = [s for s in all_steps if store.exists(f"{mf.step_dir(s)}/{mf.COMMIT}")]
    if not committed:
        return out
    counted, out.out_of_nowhere = trusted_steps(committed, max_step_jump)
    keep = set(counted[-keep_last:]) | set(protect) | set(out.out_of_nowhere)
    for s in reversed(counted):
        why = check_restorable(store, s)
        if why is not None:
            out.failed[s] = why
            continue
        if out.restorable is None:
            out.restorable = s
            keep.add(s)
        rec = read_record(store, s)
        if rec is None or rec["ok"]:
            keep.add(s)  # the newest restorable step verify did not record bad
            break
    if out.restorable is None:
        log.warning("%s: no committed step passes the restorability check; retention keeps every step", store.uri)
        keep |= set(committed)
    verified = newest_verified(store, counted)
    if verified is not None:
        keep.add(verified)
    out.doomed = [s for s in all_steps if s < committed[-1] and s not in keep]
    return out


def select_for_deletion(
    store: Store,
    keep_last: int,
    protect: set[int] | frozenset[int] = frozenset(),
    max_step_jump: int | None = DEFAULT_MAX_STEP_JUMP,
) -> list[int]:
    """The steps ``retain`` would delete, ascending (:func:`plan`)."""
    return plan(store, keep_last, protect, max_step_jump).doomed


def newest_verified(store: Store, committed: list[int]) -> int | None:
    """The newest of ``committed`` whose ``ckptd verify`` record says it passed, or None (kept
    whatever ``keep_last`` says). One GET per committed step newer than it (retention keeps few)."""
    for s in reversed(committed):
        rec = read_record(store, s)
        if rec is not None and rec["ok"]:
            return s
    return None


def retain(
    store: Store,
    keep_last: int,
    protect: set[int] | frozenset[int] = frozenset(),
    max_step_jump: int | None = DEFAULT_MAX_STEP_JUMP,
) -> list[int]:
    """Apply retention: delete what :func:`select_for_deletion` selects. Returns deleted steps."""
    doomed = select_for_deletion(store, keep_last, protect, max_step_jump)
    for s in doomed:
        catalog.delete_checkpoint(store, s)
    return doomed


__all__ = [
    "DEFAULT_MAX_STEP_JUMP",
    "Plan",
    "after_commit",
    "apply_retention",
    "check_restorable",
    "check_step_jump",
    "max_step_jump_default",
    "newest_verified",
    "plan",
    "retain",
    "select_for_deletion",
    "sweep_leftovers",
    "trusted_steps",
]
