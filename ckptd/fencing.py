"""The operator's side of fencing: retire a dead job's claims (``ckptd fence``), tell a resumed
job which partial steps of another job lie in its way, and find the objects of a committed step
that its committing attempt does not own (``ckptd verify``'s warnings).

Invariant: a live writer is never fenced off early. :func:`fence` writes a *fencing claim*
(``{"writer": "ckptd-fence", "fenced": JOB, ...}``, a claim like any other: created with
``put_if_absent`` as claim ``n+1``, never deleted) above JOB's newest claim on each of its
partial steps -- only where that claim's lease has run out (:func:`ckptd.claims.liveness`),
unless ``force``. A fencing claim is never alive: the next writer of the step (any job) takes
it over at once, and its takeover removes what the fenced attempt left (``claims.begin``). The
fenced attempt, should it wake up, finds its claim superseded: it can no longer commit, its
create-only writes cannot replace the new owner's objects, and its cleanup deletes nothing.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from ckptd import catalog, claims, commit
from ckptd import manifest as mf
from ckptd.claims import FENCE_WRITER, is_fence
from ckptd.errors import CheckpointError
from storage_backends import StorageError, Store

__all__ = ["FENCE_WRITER", "Fenced", "fence", "is_fence", "unowned"]

log = logging.getLogger("ckptd.fencing")


@dataclass(frozen=True)
class Fenced:
    step: int
    attempt: str  # the fenced job's attempt
    idle: float  # seconds since its last heartbeat (or write, for claims without a lease)
    what: str  # "last heartbeat" or "last write"


def fence(store: Store, job: str, step: int | None = None, *, force: bool = False) -> list[Fenced]:
    """Retire ``job``'s claims on its partial steps (every one, or ``step``): a fencing claim
    above each. Refuses (CheckpointError, nothing written) while a claim of ``job`` is still
    alive, unless ``force``. Returns what was fenced."""
    claims.check_writer(job)
    found: list[tuple[int, int, dict, float, float, str]] = []
    for s in [step] if step is not None else catalog.steps(store):
        if store.exists(f"{mf.step_dir(s)}/{mf.COMMIT}"):  # only partial steps are fenced
            if step is not None:
                raise CheckpointError(f"{catalog.where(store, s)}: step {s} is committed; nothing to fence")
            continue
        cs = claims.claims(store, s)
        if not cs or cs[-1][1].get("writer") != job:
            if step is not None:
                holder = cs[-1][1].get("writer") if cs else None
                raise CheckpointError(
                    f"{catalog.where(store, s)}: step {s} is not claimed by job {job!r} (newest claim: "
                    f"{holder!r}); nothing to fence"
                )
            continue
        n, rec = cs[-1]
        idle, limit, what = claims.liveness(store, s, n, rec)
        if idle < limit and not force:
            raise CheckpointError(
                f"{catalog.where(store, s)}: job {job!r} is alive on step {s} ({what} {idle:.0f} s ago, "
                f"lease {limit:.0f} s); refusing to fence a live writer (--force if you are sure it is dead)"
            )
        found.append((s, n, rec, idle, limit, what))
    out = []
    for s, n, rec, idle, _, what in found:
        record = {
            "writer": FENCE_WRITER,
            "attempt": f"fence-{uuid.uuid4().hex[:12]}",
            "time": time.time(),
            "fenced": job,
            "fenced_attempt": str(rec.get("attempt")),
        }
        try:
            won = store.put_if_absent(claims.claim_key(s, n + 1), mf.dumps(record))
        except StorageError as e:
            raise CheckpointError(f"{catalog.where(store, s)}: cannot fence step {s}: {e}") from e
        if not won:
            raise CheckpointError(
                f"{catalog.where(store, s)}: step {s} was claimed again while fencing it (a writer is alive); "
                "nothing fenced there"
            )
        log.warning("fenced job %r off %s (%s %.0f s ago)", job, catalog.where(store, s), what, idle)
        out.append(Fenced(s, str(rec.get("attempt")), idle, what))
    return out


def unowned(store: Store, m: mf.Manifest, attempt: str | None) -> list[str]:
    """Objects of committed step ``m.step`` that its committing ``attempt`` does not own: array
    objects (under ``arrays/``) the manifest does not name, and done records of other attempts
    -- what a superseded attempt left (a 4-rank attempt's ``c/2/0`` in a 2-rank commit) or
    wrote late. Restore never reads them; ``ckptd verify`` reports them as warnings."""
    folder = f"{mf.step_dir(m.step)}/"
    expected = {key for key, _ in mf.group_nodes(m.tensors, m.step)} | commit.expected_shards(m)
    expected.update(f"{entry.path}/zarr.json" for entry in m.tensors.values())
    own_done = f"{mf.DONE}/{attempt}/"
    out = []
    for o in store.list(folder):
        rel = o.key[len(folder) :]
        stray_array = rel.startswith(f"{mf.ARRAYS}/") and rel not in expected
        stray_done = rel.startswith(f"{mf.DONE}/") and not rel.startswith(own_done)
        if stray_array or stray_done:
            out.append(rel)
    return out
