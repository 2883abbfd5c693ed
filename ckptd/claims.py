"""Step claims: which writer owns a step, decided before a byte of it is written.

Invariant: a step is written by one (writer, attempt) at a time, and committed only by the one
its newest claim names (``ckptd.commit`` re-checks it at the commit, ``ckptd verify`` after).
Claims are created with ``put_if_absent`` only and never deleted or replaced, so two writers
cannot both believe they own a step. The argument in full: ``docs/reliability.md``, "Fencing".

Writer identity and fencing (two jobs on one root are refused, never mixed)
---------------------------------------------------------------------------
A *writer* is a job id (``Checkpointer(job_id=...)``; :func:`check_writer`); an *attempt* is one
save of one step by that writer (a fresh id per save). Before writing a byte, an attempt claims
the step (:func:`begin`) by creating the claim record ``<step>/_claims/<n>.json`` naming
(writer, attempt); the step belongs to the newest claim (:func:`owner`). A claimant that finds
the newest claim naming:

* its own attempt: proceeds (another rank of the attempt made the claim);
* another attempt of its *own writer* (the same job restarted after preemption, or a save of
  this step that failed): takes the step over by creating claim ``n+1`` -- unless its own
  attempt already held an older claim (it was superseded: it never takes the step back);
* another writer whose lease ran out (:func:`liveness`, ``ckptd.leases``): takes it over the
  same way, with a warning; an operator's fencing claim (``ckptd fence``) is never alive;
* another writer, alive: refuses with :class:`StepClaimed`, naming that job and the
  ``ckptd fence`` command, and writes and deletes nothing.

A takeover first removes what the superseded attempts left (:func:`clear_superseded`), before a
byte of its own is written; data is written create-only (``Store.put_new``) and a superseded
attempt deletes nothing in its cleanup (``persist.clean_up``). Claim numbers are total:
``<n>.json`` is six digits or more (``999999`` is followed by ``1000000``).

A committed step is never claimed again (:class:`AlreadyCommitted`, before a byte is written).
The in-process writer deletes the leftovers of its own failed saves at its next save
(:func:`reclaim`).

One claim per attempt (issue 17): the call sequence
---------------------------------------------------
At N ranks, a ``begin`` on every rank is ~3N requests on ``<step>`` and ``<step>/_claims`` in
the first tenth of a second of a save: over S3's 5500 reads/s per prefix from ~2750 ranks. So::

    1. rank 0:      lead_claim(...)   begin(...), then its outcome -- go, or the refusal with its
                                      error class and message -- to
                                      <step>/_claims/<attempt>/<g>/go.json for every group g of
                                      64 ranks (put_if_absent, in parallel; a prefix per group)
    2. rank r > 0:  follow_claim(...) polls record r // 64; returns on go, raises rank 0's refusal
    3. every rank:  writes its data (ckptd.persist), only after 1 or 2 returned

The fencing is ``begin``'s, decided once. The outcome records are attempt-scoped, are not claims
(:func:`claims` reads only ``_claims/<n>.json``), and do not count as activity for the stale
takeover (a refused job's records must not keep a dead job's step alive). The daemon shares one
claim among the ranks it serves instead (``ckptd.server.shared_claim.SharedClaim``).
"""

from __future__ import annotations

import logging
import random
import re
import shlex
import threading
import time

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import AlreadyCommitted, CheckpointError, SaveAborted, StepClaimed, StepHeld
from ckptd.leases import idle_seconds, lease_age, lease_s, stale_after
from ckptd.manifest import CLAIMS
from storage_backends import NotFoundError, StorageError, Store

log = logging.getLogger("ckptd.claims")

WRITER_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


# A claim file name: six digits, or more without a leading zero (total: 999999 -> 1000000).
_CLAIM_NAME = re.compile(r"(\d{6}|[1-9]\d{6,17})\.json")


FENCE_WRITER = "ckptd-fence"  # the writer of an operator's fencing claim (``ckptd.fencing``)


def is_fence(rec: dict) -> bool:
    """Whether a claim record is an operator's fencing claim (never alive)."""
    return rec.get("writer") == FENCE_WRITER and isinstance(rec.get("fenced"), str)


def check_writer(writer: str) -> str:
    if not isinstance(writer, str) or not WRITER_RE.match(writer):
        raise CheckpointError(f"invalid writer (job) id {writer!r}: 1-128 of A-Z a-z 0-9 _ . : @ -")
    return writer


def claim_key(step: int, n: int) -> str:
    return f"{mf.step_dir(step)}/{CLAIMS}/{n:06d}.json"


def claims(store: Store, step: int) -> list[tuple[int, dict]]:
    """The claims of ``step``, oldest first, as (number, record); a malformed record reads as
    ``{}`` (an unknown writer). A claim that cannot be read (the store failed or throttled the
    GET after its retries) is a CheckpointError: it is no evidence of another writer, and
    reading it as one refused a job its own step under SlowDowns."""
    prefix = f"{mf.step_dir(step)}/{CLAIMS}/"
    out = []
    for o in store.list(prefix):
        name = o.key[len(prefix) :]
        if not _CLAIM_NAME.fullmatch(name):
            continue
        try:
            data = store.get(o.key, limit=mf.MAX_RECORD_BYTES)
        except NotFoundError:
            data = b""
        except StorageError as e:
            raise CheckpointError(f"{prefix}: cannot read claim {name} ({e}); not deciding who owns the step") from e
        try:
            rec = mf.loads(data, prefix, "claim")
        except CheckpointError:
            rec = {}
        out.append((int(name[:-5]), rec if isinstance(rec, dict) else {}))
    return sorted(out, key=lambda x: x[0])


def owner(store: Store, step: int) -> dict | None:
    """The newest claim of ``step`` (who owns it), or None if nobody claimed it."""
    cs = claims(store, step)
    return cs[-1][1] if cs else None


def begin(store: Store, step: int, attempt: str, writer: str, *, sole: bool = True) -> None:
    """Claim ``step`` for (``writer``, ``attempt``) before writing a byte of it; see the module
    docstring for the rule. Called by every rank of the attempt (it is idempotent across them).
    Raises AlreadyCommitted, StepClaimed or CheckpointError; writes nothing but a claim, and on a
    takeover deletes what the superseded attempts left (:func:`clear_superseded`). ``sole``: no
    rank of this attempt writes before this call returns (rank 0's claim, the daemon's); False
    (``persist(claim="each")``) keeps objects as new as the claim, which another rank of the
    attempt may have written already."""
    where = catalog.where(store, step)
    record = mf.dumps({"writer": writer, "attempt": attempt, "time": time.time(), "lease": lease_s()})
    try:
        for _ in range(16):
            if store.exists(f"{mf.step_dir(step)}/{mf.COMMIT}"):
                raise AlreadyCommitted(f"{where}: step {step} is already committed; refusing to overwrite")
            cs = claims(store, step)
            if not cs:
                if store.put_if_absent(claim_key(step, 0), record):
                    return
                continue  # another rank (or writer) claimed it first: look again
            n, rec = cs[-1]
            if rec.get("attempt") == attempt:
                return
            if any(r.get("attempt") == attempt for _, r in cs):  # e.g. resumed after a daemon restart
                raise StepClaimed(
                    f"{where}: attempt {attempt} was superseded by attempt {rec.get('attempt')!r} of job "
                    f"{rec.get('writer')!r}; it never takes the step back"
                )
            other = rec.get("writer") or "an unknown writer"
            if rec.get("writer") != writer:
                idle, limit, what = liveness(store, step, n, rec)
                if idle < limit:
                    named = isinstance(rec.get("writer"), str) and WRITER_RE.match(rec["writer"])
                    retire = (
                        f"or retire it now with `ckptd fence {shlex.quote(store.uri)} --job {rec['writer']}`"
                        if named
                        else f"its claim record {claim_key(step, n)} names no job (damaged or forged)"
                    )
                    raise StepHeld(
                        f"{where}: step {step} is being written by job {other!r} (attempt "
                        f"{rec.get('attempt')!r}, {what} {idle:.0f} s ago); refusing to write it as job "
                        f"{writer!r}: two writers on one job root. Stop the other job; if it is dead, "
                        f"its claim expires {limit:.0f} s after its {what}; {retire}"
                    )
                seen = f"{what} {idle:.0f} s ago" if idle != float("inf") else what
                log.warning("%s: taking over step %d from job %r, %s", where, step, other, seen)
            if store.put_if_absent(claim_key(step, n + 1), record):
                if rec.get("writer") == writer:
                    log.info(
                        "%s: attempt %s replaces this job's earlier attempt %s", where, attempt, rec.get("attempt")
                    )
                clear_superseded(store, step, where, None if sole else claim_key(step, n + 1))
                return
        raise CheckpointError(f"{where}: could not claim step {step}: too many concurrent claims")
    except StorageError as e:
        raise CheckpointError(f"{where}: cannot claim step {step}: {e}") from e


def liveness(store: Store, step: int, n: int, rec: dict) -> tuple[float, float, str]:
    """(seconds since the owner of claim ``n`` was last seen alive, the limit past which it may
    be taken over, what was seen), by the rules of ``ckptd.leases`` (a claim given up with
    ``leases.abandon`` is dead at once). An operator's fencing claim (``ckptd fence``) is never
    alive."""
    if is_fence(rec):
        return float("inf"), 0.0, "fencing claim (ckptd fence), written"
    if isinstance(rec.get("lease"), int | float) and isinstance(rec.get("attempt"), str):
        attempt = rec["attempt"]
        if WRITER_RE.match(attempt):
            age = lease_age(store, step, claim_key(step, n), attempt)
            return age, lease_s(), "last heartbeat" if age != float("inf") else "claim given up by its writer"
    return idle_seconds(store, step), stale_after(), "last write"


def clear_superseded(store: Store, step: int, where: str, newer_than: str | None = None) -> int:
    """Remove every object the superseded attempts left in ``step`` (data, metadata, done
    records; never ``commit.json`` and nothing under ``_claims/``: the claims, and the small
    attempt-scoped outcome and heartbeat records, which a superseded attempt's ranks still read
    to learn at once that they were superseded) right after this attempt's claim superseded
    them and before it writes a byte: with create-only data writes a late write of theirs then
    either lands before ours (our create fails: the save fails, never mixed) or fails. A commit
    record found here: AlreadyCommitted, nothing deleted. ``newer_than`` (a claim key): objects
    written since that claim (storage times) are kept -- the claimant's own ranks may be writing
    already."""
    folder = f"{mf.step_dir(step)}/"
    claims_prefix = f"{folder}{CLAIMS}/"
    since = store.head(newer_than).mtime if newer_than is not None else None
    doomed = []
    for o in store.list(folder):
        if since is not None and o.mtime >= since:
            continue
        rel = o.key[len(folder) :]
        if rel == mf.COMMIT:
            raise AlreadyCommitted(f"{where}: step {step} was committed by the attempt being taken over")
        if o.key.startswith(claims_prefix):
            continue
        doomed.append(o.key)
    for key in doomed:
        store.delete(key)
    if doomed:
        log.warning("%s: removed %d objects of the superseded attempts before writing", where, len(doomed))
    return len(doomed)


# -- one claim per attempt (issue 17): rank 0 claims, the others read its outcome ----------------

LEADER = 0  # the rank that claims the step for its attempt (it also writes the manifest)

OUTCOME_GROUP = 64  # ranks reading one outcome record, each record on a prefix of its own


def outcome_key(step: int, attempt: str, group: int) -> str:
    """The claim outcome that ranks ``[64 * group, 64 * group + 64)`` of ``attempt`` read."""
    return f"{mf.step_dir(step)}/{CLAIMS}/{attempt}/{group:06d}/go.json"


def outcome_keys(step: int, attempt: str, world_size: int) -> list[str]:
    return [outcome_key(step, attempt, g) for g in range(-(-world_size // OUTCOME_GROUP))]


# Refusals by kind, as claim outcome records and daemon job statuses name them: a closed set
REFUSALS = {"AlreadyCommitted": AlreadyCommitted, "StepClaimed": StepClaimed, "StepHeld": StepHeld}


def lead_claim(store: Store, step: int, attempt: str, writer: str, world_size: int, pool) -> None:
    """Step 1 of the module docstring's call sequence (outcomes put in parallel on ``pool``).
    Raises what ``begin`` raised after publishing it, so the other ranks fail at once with the
    same error, or CheckpointError when the outcome cannot be published (they then fail at
    their deadline)."""
    where = catalog.where(store, step)
    err: CheckpointError | None = None
    try:
        begin(store, step, attempt, writer)
    except CheckpointError as e:
        err = e
    outcome = {"ok": err is None, "writer": writer, "attempt": attempt, "time": time.time()}
    if err is not None:
        outcome.update(error=type(err).__name__, message=str(err))
    data = mf.dumps(outcome)
    futures = [pool.submit(store.put_if_absent, key, data) for key in outcome_keys(step, attempt, world_size)]
    failed, existed = None, False
    for f in futures:
        try:
            existed = existed or not f.result()
        except StorageError as e:
            failed = failed or e
    if err is not None:
        raise err
    if failed is not None:
        raise CheckpointError(f"{where}: cannot tell the other ranks that step {step} is claimed: {failed}")
    if existed:  # an earlier try of this attempt (a retried persist) published first: it stands
        prev = _read_outcome(store, outcome_key(step, attempt, 0), attempt, writer, where)
        if prev is not None and not prev["ok"]:
            raise _refusal(prev)


def follow_claim(
    store: Store,
    step: int,
    attempt: str,
    writer: str,
    rank: int,
    timeout: float,
    abort: threading.Event | None = None,
) -> None:
    """A rank other than 0: wait for rank 0's claim outcome of ``attempt`` (its group's record,
    polled with pauses that double from ~2 round trips up to 0.1 s: 64 ranks per record stay
    under ~1000 reads/s on its prefix). Returns on go; raises rank 0's AlreadyCommitted or
    StepClaimed (same message); CheckpointError after ``timeout`` seconds without an outcome
    (rank 0 died or cannot reach storage) or once ``abort`` is set. An outcome older than a
    quarter of ``CKPTD_STALE_ATTEMPT_S`` (a save resumed long after rank 0 claimed) is not
    trusted: this rank runs :func:`begin` itself, so no rank writes on a stale verdict."""
    where = catalog.where(store, step)
    key = outcome_key(step, attempt, rank // OUTCOME_GROUP)
    deadline = time.monotonic() + timeout
    rng = random.Random(rank * 7919 + step)
    k = 0
    while True:
        check_abort(abort, where)
        t = time.monotonic()
        rec = _read_outcome(store, key, attempt, writer, where)
        rtt = time.monotonic() - t
        if rec is not None:
            if not rec["ok"]:
                raise _refusal(rec)
            if not trusted(rec["time"]):
                begin(store, step, attempt, writer)
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{where}: rank {LEADER} did not claim step {step} for attempt {attempt} within {timeout:.0f} s; "
                f"rank {rank} writes nothing"
            )
        time.sleep(min(0.1, max(0.001, 1.5 * rtt * 2**k)) * (0.75 + 0.5 * rng.random()))
        k = min(k + 1, 16)


def trusted(claimed_at: float) -> bool:
    """Whether a claim outcome decided at wall-clock time ``claimed_at`` may still be acted on
    without a :func:`begin` of one's own: for a quarter of ``CKPTD_STALE_ATTEMPT_S``. Past that,
    another writer may have taken a step that looked idle over, so a rank that writes on a go
    that old could mix its data into that writer's."""
    return time.time() - claimed_at <= min(stale_after(), lease_s()) / 4


def _read_outcome(store: Store, key: str, attempt: str, writer: str, where: str) -> dict | None:
    """The outcome record at ``key``, checked; None if absent."""
    try:
        rec = mf.read_json(store, key, where, "claim outcome")
    except NotFoundError:
        return None
    ok = (
        isinstance(rec, dict)
        and isinstance(rec.get("ok"), bool)
        and rec.get("attempt") == attempt
        and rec.get("writer") == writer
        and isinstance(rec.get("time"), int | float)
    )
    if not ok:
        raise CheckpointError(f"{where}: claim outcome {key} is malformed or names another writer; writing nothing")
    return rec


def _refusal(rec: dict) -> CheckpointError:
    return REFUSALS.get(rec.get("error"), CheckpointError)(str(rec.get("message") or "claim refused by rank 0"))


def check_abort(abort: threading.Event | None, where: str) -> None:
    """Raise SaveAborted once ``abort`` (the caller's deadline passed) is set."""
    if abort is not None and abort.is_set():
        raise SaveAborted(f"{where}: save abandoned after its deadline")


def reclaim(store: Store, steps: list[int], writer: str, attempts: set[str] | None = None) -> list[int]:
    """Delete the folders of ``steps`` that are still partial and whose newest claim is
    ``writer``'s -- and, given ``attempts``, one of those attempts (the caller's own failed
    saves: a restarted process of the same job that took a step over since is another attempt,
    whose data is not ours to delete): leftovers of this writer's failed saves. Call it only
    when no rank of those attempts can still be writing them (the in-process writer: at its
    next save). Best effort: failures are logged. Returns the steps deleted."""
    gone = []
    for step in steps:
        try:
            rec = owner(store, step)
            if store.exists(f"{mf.step_dir(step)}/{mf.COMMIT}") or rec is None or rec.get("writer") != writer:
                continue
            if attempts is not None and rec.get("attempt") not in attempts:
                continue
            n = store.delete_prefix(f"{mf.step_dir(step)}/")
            log.warning("removed %d objects of this job's failed save %s", n, catalog.where(store, step))
            gone.append(step)
        except (StorageError, CheckpointError) as e:
            log.warning("cannot remove the failed save %s: %s", catalog.where(store, step), e)
    return gone


__all__ = [
    "clear_superseded",
    "liveness",
    "LEADER",
    "OUTCOME_GROUP",
    "REFUSALS",
    "begin",
    "check_abort",
    "check_writer",
    "claim_key",
    "claims",
    "follow_claim",
    "lead_claim",
    "outcome_key",
    "outcome_keys",
    "owner",
    "reclaim",
    "trusted",
]
