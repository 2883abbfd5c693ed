"""The commit protocol: how one writer's part of a checkpoint becomes a committed checkpoint.

Every writer calls this module -- the in-process background writer
(``trainer_hooks.writer.BackgroundWriter``), the ``ckptd serve`` daemon (``ckptd.server.jobs``)
and the streaming :class:`ckptd.stream.CheckpointWriter` (``ckptd import``, ``reshard
--rechunk``) -- so a save has one order of writes wherever it runs. For one step, on every
rank (a *part* below is one rank's share of the step), on a background thread::

    persist(store, part, pool, writer=JOB)
        claim                 # rank 0: begin(...) -- refuse a committed step, claim the step
                              # for (JOB, attempt) -- then publish the outcome (lead_claim);
                              # the others wait for it (follow_claim); see "One claim per
                              # attempt" below. The daemon: one begin per attempt for the
                              # ranks it serves (SharedClaim, then persist(claim="caller")).
        write data            # shards + metadata with put_deferred, in parallel
        store.sync()          # one durability barrier for all of it
        finish_rank(...)      # this rank's done record into the done tree (its data is
                              # durable), then climb the tree (ckptd.donetree); the rank that
                              # completes it checks that claim, manifest and done records name
                              # one attempt and account for every shard, then writes
                              # commit.json once (commit_step: put_if_absent)
        wait_commit(...)      # the others poll for it (bounded by commit_timeout)
      on failure before the done record: delete what this rank wrote (best effort, logged)
    after_commit(store, result, keep_last)   # retention, by the committing writer, after its
                                             # result is reported (never delays the save)

Writer identity and fencing (two jobs on one root are refused, never mixed)
---------------------------------------------------------------------------
A *writer* is a job id (``Checkpointer(job_id=...)``; by default ``TORCHELASTIC_RUN_ID``,
``SLURM_JOB_ID``, or a uuid agreed across ranks); an *attempt* is one save of one step by that
writer (a fresh id per save). Before writing a byte, an attempt claims the step (rank 0 for
all its ranks, see below) with a conditional create (``put_if_absent``, atomic on a filesystem and on S3) of the claim
record ``<step>/_claims/<n>.json`` naming (writer, attempt); the step belongs to the newest
claim. A claimant that finds the newest claim naming:

* its own attempt: proceeds (another rank of the attempt made the claim);
* another attempt of its *own writer* (the same job restarted after preemption, or a save of
  this step that failed): takes the step over by creating claim ``n+1`` -- unless its own
  attempt already held an older claim (it was superseded: it never takes the step back);
* another writer, whose step folder has seen no write for ``CKPTD_STALE_ATTEMPT_S`` seconds
  (default 900, i.e. the other job is dead): takes it over the same way, with a warning;
* another writer, recently active: refuses with :class:`StepClaimed`, naming that job, and
  writes and deletes nothing.

Claims are never deleted or replaced, only superseded by a higher number through
``put_if_absent``, so two writers cannot both believe they own a step. ``commit.json`` is
written only when the newest claim, ``manifest.json`` and the done records all name the
committing attempt (``ckptd verify`` re-checks it). A committed step is never claimed again
(:class:`AlreadyCommitted`, before a byte is written).

Failure and cleanup: a rank that fails before its done record deletes the objects it wrote
(best effort, logged). Once its done record is durable the data is no longer its own to
retract: another rank may commit it. The in-process writer also remembers steps whose save
failed and, at its next save (after the collective that proves no rank of the job still writes
them), deletes those folders if they are still partial and claimed by its own writer.

One claim per attempt (issue 17)
--------------------------------
At N ranks, a ``begin`` on every rank is ~3N requests on ``<step>`` and ``<step>/_claims`` in
the first tenth of a second of a save: over S3's 5500 reads/s per prefix from ~2750 ranks. So
rank 0 alone runs ``begin`` for the attempt and writes its outcome -- go, or the refusal with
its error class and message -- to ``<step>/_claims/<attempt>/<g>/go.json`` for every group g of
64 ranks (``put_if_absent``, in parallel on its I/O pool; each group's record on a prefix of its
own, like the done tree). Rank r polls record ``r // 64`` (pauses doubling from ~2 round trips
up to 0.1 s) and writes no byte before a go: the fencing is ``begin``'s, decided once. A refusal
fails every rank at once with rank 0's StepClaimed / AlreadyCommitted; without an outcome (rank
0 died or cannot reach storage) a rank fails when ``commit_timeout`` runs out or its save is
aborted, having written nothing. A go older than ``CKPTD_STALE_ATTEMPT_S / 4`` is not trusted
(a rank resumed long after rank 0 claimed): that rank runs ``begin`` itself. The records are
attempt-scoped (a retried save has a new attempt, hence new keys), are not claims (``claims``
reads only ``_claims/<n>.json``), and do not count as activity for the stale takeover (a refused
job's records must not keep a dead job's step alive). Writing a refusal into another job's or a
committed step adds only these records, never data.

The daemon cannot wait for rank 0 (its upload workers are bounded, and parts waiting for a rank
0 queued behind them would hold them all), so it claims once per attempt for the ranks it
serves (a node's, typically 8): the first of its jobs of (root, step, attempt, writer) runs
``begin`` through a :class:`SharedClaim`, the daemon's other jobs of that attempt wait for that
running ``begin`` (never for a queued job) and share its outcome -- go, or the same
StepClaimed / AlreadyCommitted -- then ``persist(claim="caller")``. Only definitive outcomes are
shared; after a transient failure the next job claims again; a go is trusted for the same
quarter of ``CKPTD_STALE_ATTEMPT_S`` (:func:`trusted`). ``persist(claim="each")`` (every part runs
``begin``) remains for callers that share nothing.

A ``part`` is duck-typed (``trainer_hooks.snapshot.SaveJob`` is one): ``step``, ``attempt``,
``rank``, ``world_size``, ``metadata`` (``[(key in the folder, bytes)]``), ``shards`` (objects
with ``layout``, ``coord``, ``object_key``, ``buffer``, ``image``, ``chunks``), ``done`` (extra
fields of the done record) and ``ready`` (an event with ``synchronize()`` or None). Turning a
shard's ``buffer`` into a numpy array is the caller's business (``to_numpy``): this module
knows numpy and the store, not torch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptd import catalog, donetree, latest
from ckptd import manifest as mf
from ckptd.codec import encode_shard, seal_image
from ckptd.errors import CheckpointError
from storage_backends import NotFoundError, StorageError, Store
from storage_backends.base import data_size

log = logging.getLogger("ckptd.commit")

CLAIMS = "_claims"  # <step>/_claims/<n>.json: who owns the step (the newest claim); <attempt>/<g>/go.json: outcomes
WRITER_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
DEFAULT_STALE_S = 900.0


class AlreadyCommitted(CheckpointError):
    """The step already has ``commit.json``: a committed checkpoint is immutable."""


class StepClaimed(CheckpointError):
    """Another writer (job) is writing this step: two writers on one root are refused."""


class SaveAborted(CheckpointError):
    """The save's deadline passed; what was not yet durable is not made so."""


@dataclass(frozen=True)
class SaveResult:
    step: int
    bytes_written: int
    objects_written: int
    committed_here: bool  # this rank wrote the commit record
    seconds: float  # from the start of persisting to commit
    # where those seconds went on this rank (None through a daemon): writing its objects, making
    # them durable (one sync), and its done record + commit attempt + waiting for the commit
    phases: dict[str, float] | None = None
    # wall-clock time this rank started persisting: every write of this attempt that can still be
    # in flight at the commit (another rank's losing put_if_absent of commit.json) began after it
    started_at: float | None = None


def stale_after() -> float:
    """Seconds without a write after which another writer's partial step may be taken over
    (``CKPTD_STALE_ATTEMPT_S``, default 900)."""
    raw = os.environ.get("CKPTD_STALE_ATTEMPT_S", "").strip()
    try:
        return float(raw) if raw else DEFAULT_STALE_S
    except ValueError:
        raise CheckpointError(f"CKPTD_STALE_ATTEMPT_S={raw!r}: expected a number of seconds") from None


def check_writer(writer: str) -> str:
    if not isinstance(writer, str) or not WRITER_RE.match(writer):
        raise CheckpointError(f"invalid writer (job) id {writer!r}: 1-128 of A-Z a-z 0-9 _ . : @ -")
    return writer


# ------------------------------------------------------------------------------------ begin


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
        if not re.fullmatch(r"\d{6}\.json", name):
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
        out.append((int(name[:6]), rec if isinstance(rec, dict) else {}))
    return sorted(out, key=lambda x: x[0])


def owner(store: Store, step: int) -> dict | None:
    """The newest claim of ``step`` (who owns it), or None if nobody claimed it."""
    cs = claims(store, step)
    return cs[-1][1] if cs else None


def _idle_seconds(store: Store, step: int) -> float:
    """Seconds since the newest write to the step folder, not counting claim outcomes
    (``_claims/<attempt>/...``): a refused writer's outcome records must not keep a dead job's
    step looking alive, or a job retrying the step would never reach the stale takeover."""
    prefix = f"{mf.step_dir(step)}/"
    outcomes = f"{prefix}{CLAIMS}/"
    newest = max(
        (o.mtime for o in store.list(prefix) if not (o.key.startswith(outcomes) and "/" in o.key[len(outcomes) :])),
        default=0.0,
    )
    return time.time() - newest


def begin(store: Store, step: int, attempt: str, writer: str) -> None:
    """Claim ``step`` for (``writer``, ``attempt``) before writing a byte of it; see the module
    docstring for the rule. Called by every rank of the attempt (it is idempotent across them).
    Raises AlreadyCommitted, StepClaimed or CheckpointError; writes nothing but a claim."""
    where = catalog.where(store, step)
    record = mf.dumps({"writer": writer, "attempt": attempt, "time": time.time()})
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
                idle = _idle_seconds(store, step)
                limit = stale_after()
                if idle < limit:
                    raise StepClaimed(
                        f"{where}: step {step} is being written by job {other!r} (attempt "
                        f"{rec.get('attempt')!r}, last write {idle:.0f} s ago); refusing to write it as job "
                        f"{writer!r}: two writers on one job root. Stop the other job, or wait "
                        f"{limit:.0f} s (CKPTD_STALE_ATTEMPT_S) if it is dead"
                    )
                log.warning("%s: taking over step %d from job %r, idle for %.0f s", where, step, other, idle)
            if store.put_if_absent(claim_key(step, n + 1), record):
                if rec.get("writer") == writer:
                    log.info(
                        "%s: attempt %s replaces this job's earlier attempt %s", where, attempt, rec.get("attempt")
                    )
                return
        raise CheckpointError(f"{where}: could not claim step {step}: too many concurrent claims")
    except StorageError as e:
        raise CheckpointError(f"{where}: cannot claim step {step}: {e}") from e


# -- one claim per attempt (issue 17): rank 0 claims, the others read its outcome ----------------

LEADER = 0  # the rank that claims the step for its attempt (it also writes the manifest)
OUTCOME_GROUP = 64  # ranks reading one outcome record, each record on a prefix of its own


def outcome_key(step: int, attempt: str, group: int) -> str:
    """The claim outcome that ranks ``[64 * group, 64 * group + 64)`` of ``attempt`` read."""
    return f"{mf.step_dir(step)}/{CLAIMS}/{attempt}/{group:06d}/go.json"


def outcome_keys(step: int, attempt: str, world_size: int) -> list[str]:
    return [outcome_key(step, attempt, g) for g in range(-(-world_size // OUTCOME_GROUP))]


_REFUSALS = {"AlreadyCommitted": AlreadyCommitted, "StepClaimed": StepClaimed}


def lead_claim(store: Store, step: int, attempt: str, writer: str, world_size: int, pool) -> None:
    """Rank 0's claim for the whole attempt: :func:`begin`, then its outcome -- go, or the
    refusal with its error -- published to every group of ``OUTCOME_GROUP`` ranks with
    ``put_if_absent``, in parallel on ``pool``. Raises what ``begin`` raised (after publishing
    it, so the other ranks fail at once with the same error), or CheckpointError when the
    outcome cannot be published (the other ranks then fail at their deadline)."""
    where = catalog.where(store, step)
    err: CheckpointError | None = None
    try:
        begin(store, step, attempt, writer)
        outcome: dict = {"ok": True, "writer": writer, "attempt": attempt, "time": time.time()}
    except CheckpointError as e:
        err = e
        outcome = {
            "ok": False,
            "writer": writer,
            "attempt": attempt,
            "time": time.time(),
            "error": type(e).__name__,
            "message": str(e),
        }
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
        _check_abort(abort, where)
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
    return time.time() - claimed_at <= stale_after() / 4


class SharedClaim:
    """One claim per attempt among the parts one process persists (the daemon's jobs: a node's
    ranks hand off to one daemon), for ``persist(claim="caller")``.

    :meth:`claim` is called by each part before it writes (root, step, attempt, writer name the
    claim). The first caller runs :func:`begin`; callers that come while it runs wait for that
    running ``begin`` -- never for a queued part, so a bounded worker pool cannot deadlock --
    and get its outcome: return (go), or the same ``AlreadyCommitted`` / ``StepClaimed`` (same
    message). Only those definitive outcomes are kept. A transient failure (the store failed or
    throttled; CheckpointError "cannot claim/read") is raised to the part that ran ``begin`` and
    kept for nobody: a waiting part, or the next one, runs ``begin`` again. A go is trusted for a
    quarter of ``CKPTD_STALE_ATTEMPT_S`` (:func:`trusted`, as ``follow_claim`` trusts rank 0's
    go), then the next part runs ``begin`` itself. A go for another attempt of the step voids the
    outcomes kept for the others (their next part runs ``begin``: a job restarted after
    preemption supersedes its dead attempt, whose parts still queued here must not write on the
    old go). Outcomes past their trust are dropped and at most ``limit`` are kept (the oldest
    decided go first), so a long-lived daemon holds a bounded table.

    ``on_begin`` is called before every ``begin`` (the daemon counts them:
    ``ckptd_step_claims_total``). ``event`` makes the object a waiter blocks on (``wait()``,
    ``set()``): ``threading.Event``, or a simulated one (``benchmarks.scale``). The lock is held
    only for the table, never across a request."""

    def __init__(
        self, on_begin: Callable[[], None] | None = None, event: Callable[[], Any] = threading.Event, limit: int = 1024
    ):
        self._on_begin = on_begin
        self._event = event
        self._limit = limit
        self._lock = threading.Lock()
        # (root, step, attempt, writer) -> [event, None while running | (wall time decided, error or None)]
        self._claims: dict[tuple, list] = {}
        self._reads: dict[tuple, list] = {}  # (root, step) -> [event, None while running | (monotonic, record)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)

    def claim(self, store: Store, root: str, step: int, attempt: str, writer: str) -> None:
        """Claim ``step`` of ``root`` (``store``) for (``writer``, ``attempt``), once for every
        part of the attempt this object serves; raises what :func:`begin` raised."""
        key = (root, step, attempt, writer)
        while True:
            with self._lock:
                self._prune()
                entry = self._claims.get(key)  # kept only while trusted (_prune)
                mine = entry is None
                if mine:
                    entry = self._claims[key] = [self._event(), None]
                    self._prune()  # the table's bound, counting this claim
            if mine:
                return self._begin(store, key, entry)
            entry[0].wait()
            outcome = entry[1]
            if outcome is None:  # its begin failed transiently: claim again (one waiter runs begin)
                continue
            if outcome[1] is not None:  # the same refusal, a fresh exception for this part's thread
                raise type(outcome[1])(str(outcome[1]))
            return None

    def committed(self, store: Store, root: str, step: int, fresh_s: float = 1.0) -> dict | None:
        """``catalog.read_commit`` of ``step`` shared the same way: one read in flight per (root,
        step), its answer (the record, or None: not committed) given to the callers that come
        while it runs or within ``fresh_s`` seconds after; a failed read is raised to its
        caller and kept for nobody. The daemon checks a step before each job (at hand-off and at
        the start of the upload); a node's jobs come within milliseconds of each other, and one
        read per job put 2N reads on the step's prefix at once. An answer up to ``fresh_s`` old
        is enough there: the hand-off's check is a fast refusal (the claim refuses a committed
        step), and the upload's guards a shared go, itself trusted for minutes."""
        key = (root, step)
        while True:
            with self._lock:
                now = time.monotonic()
                for k in [k for k, v in self._reads.items() if v[1] is not None and now - v[1][0] > fresh_s]:
                    del self._reads[k]
                entry = self._reads.get(key)
                mine = entry is None
                if mine:
                    entry = self._reads[key] = [self._event(), None]
            if not mine:
                entry[0].wait()
                if entry[1] is None:  # that read failed: read again
                    continue
                return entry[1][1]
            try:
                rec = catalog.read_commit(store, step)
                entry[1] = (time.monotonic(), rec)
                return rec
            finally:
                if entry[1] is None:
                    with self._lock:
                        if self._reads.get(key) is entry:
                            del self._reads[key]
                entry[0].set()

    def saw_commit(self, root: str, step: int, record: dict) -> None:
        """Tell the shared reads that ``step`` of ``root`` is committed (a commit record is
        final): a step this process saw committed is never answered "not committed" from an
        older read (for a minute: the table stays bounded)."""
        entry = [self._event(), (time.monotonic() + 60.0, record)]
        entry[0].set()
        with self._lock:
            self._reads[(root, step)] = entry

    def _begin(self, store: Store, key: tuple, entry: list) -> None:
        root, step, attempt, writer = key
        if self._on_begin is not None:
            self._on_begin()
        outcome = None
        try:
            begin(store, step, attempt, writer)
            outcome = (time.time(), None)
        except (AlreadyCommitted, StepClaimed) as e:
            outcome = (time.time(), e)
            raise
        finally:
            with self._lock:
                entry[1] = outcome
                if outcome is None and self._claims.get(key) is entry:
                    del self._claims[key]  # not kept: the next part claims again
                if outcome is not None and outcome[1] is None:  # this attempt owns the step now:
                    for k in [k for k, v in self._claims.items() if k[:2] == key[:2] and k != key and v[1]]:
                        del self._claims[k]  # a go of another attempt is void (it was superseded)
            entry[0].set()

    def _prune(self) -> None:
        """Drop outcomes past their trust (under the lock), then the oldest decided ones over
        ``limit``; claims still running stay (parts wait on them)."""
        decided = [(v[1][0], k) for k, v in self._claims.items() if v[1] is not None]
        for t, k in decided:
            if not trusted(t):
                del self._claims[k]
        over = len(self._claims) - self._limit
        if over > 0:
            kept = sorted((x for x in decided if x[1] in self._claims), key=lambda x: x[0])
            for _, k in kept[:over]:
                del self._claims[k]


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
    return _REFUSALS.get(rec.get("error"), CheckpointError)(str(rec.get("message") or "claim refused by rank 0"))


def reclaim(store: Store, steps: list[int], writer: str) -> list[int]:
    """Delete the folders of ``steps`` that are still partial and whose newest claim is
    ``writer``'s: leftovers of this writer's failed saves. Call it only when no rank of the
    writer can still be writing them (the in-process writer: at its next save). Best effort:
    failures are logged. Returns the steps deleted."""
    gone = []
    for step in steps:
        try:
            rec = owner(store, step)
            if store.exists(f"{mf.step_dir(step)}/{mf.COMMIT}") or rec is None or rec.get("writer") != writer:
                continue
            n = store.delete_prefix(f"{mf.step_dir(step)}/")
            log.warning("removed %d objects of this job's failed save %s", n, catalog.where(store, step))
            gone.append(step)
        except (StorageError, CheckpointError) as e:
            log.warning("cannot remove the failed save %s: %s", catalog.where(store, step), e)
    return gone


def manifest_objects(manifest: mf.Manifest) -> list[tuple[str, bytes]]:
    """The metadata objects the writer of the manifest (rank 0) puts besides its shards: the
    zarr groups of the folder and ``manifest.json``, as ``(key in the folder, bytes)``."""
    return [*mf.group_nodes(manifest.tensors, manifest.step), (mf.MANIFEST, manifest.to_bytes())]


# ---------------------------------------------------------------------------------- persist


def persist(
    store: Store,
    part: Any,
    pool: ThreadPoolExecutor,
    *,
    writer: str | None = None,
    commit_timeout: float = 1800.0,
    wait: bool = True,
    dedupe: Dedupe | None = None,
    to_numpy: Callable[[Any], np.ndarray] = np.asarray,
    abort: threading.Event | None = None,
    claim: str = "leader",
) -> SaveResult:
    """Claim the step, write one rank's ``part`` of it and commit it if it is the last rank.
    Runs on a background thread (the in-process writer's or a daemon upload worker), never on
    the training thread.

    ``writer``: the job id that fences the step (None: the attempt id, i.e. no restart can
    take over this attempt's leftovers before they go stale). ``wait=False`` returns once this
    rank's data and done record are durable (and the commit tried), without polling for the
    other ranks' commit: the daemon watches commits of many jobs from one thread.
    ``abort``: once set (the caller's deadline passed), no further object is written and
    neither the done record nor the commit, so a save reported failed never commits buffers
    the caller has reused since.

    ``dedupe`` (incremental saves): shards whose content hash equals the one this writer saved
    at the previous committed step are hard-linked (filesystem) or server-side copied (S3) from
    that checkpoint instead of uploaded; every checkpoint stays complete on its own.

    ``claim``: ``"leader"`` (default): rank 0 claims the step for the attempt and the others
    wait for its outcome (:func:`lead_claim`, :func:`follow_claim`), bounded by
    ``commit_timeout`` and ``abort``: N ranks make ~N/64 + 3 requests on the claims instead of
    3N on one prefix at once. Every rank of the attempt must be persisting (rank 0 included).
    ``"each"``: every rank runs :func:`begin` itself -- for callers that may run a rank's part
    long before or after rank 0's, or cannot run them side by side (the daemon: its bounded
    upload workers could all be taken by parts that wait for a rank 0 queued behind them).
    ``"caller"``: the caller has already claimed the step for this attempt and writer (the
    daemon: :meth:`SharedClaim.claim`, one ``begin`` per attempt for all the ranks it serves);
    ``persist`` claims nothing and writes at once. The fencing still holds at the commit: the
    newest claim must name the attempt."""
    if claim not in ("leader", "each", "caller"):
        raise ValueError(f"claim={claim!r}: expected 'leader', 'each' or 'caller'")
    t0 = time.perf_counter()
    started_at = time.time()
    where = catalog.where(store, part.step)
    writer = check_writer(writer or part.attempt)
    if part.ready is not None:
        part.ready.synchronize()  # the D2H copies into pinned buffers have landed
    if claim == "caller":
        pass
    elif claim == "each" or part.world_size == 1:
        begin(store, part.step, part.attempt, writer)
    elif part.rank == LEADER:
        lead_claim(store, part.step, part.attempt, writer, part.world_size, pool)
    else:
        follow_claim(store, part.step, part.attempt, writer, part.rank, commit_timeout, abort)
    written: list[str] = []
    try:
        nbytes, shard_keys = _write_data(store, part, pool, dedupe, to_numpy, where, written, abort)
        t_written = time.perf_counter()
        try:
            store.sync()
        except (StorageError, OSError) as e:
            raise CheckpointError(f"{where}: rank {part.rank} failed to make its data durable: {e}") from e
        _check_abort(abort, where)
    except BaseException:
        clean_up(store, where, part.rank, written)
        raise
    t_synced = time.perf_counter()
    record = {
        **part.done,  # the caller's fields first: the protocol's own cannot be overridden
        "rank": part.rank,
        "writer": writer,
        "bytes": nbytes,
        "objects": len(written),
        "shards": shard_keys,
        "time": time.time(),
    }
    try:
        donetree.write_done(store, part.step, part.attempt, part.rank, record)
        _check_abort(abort, where)
        committed = climb(store, part.step, part.attempt, part.rank, part.world_size)
    except StorageError as e:
        raise CheckpointError(f"{where}: rank {part.rank} failed to record completion: {e}") from e
    if committed:
        log.info("committed %s (%d ranks)", where, part.world_size)
    elif wait:
        wait_commit(store, part.step, part.attempt, part.world_size, commit_timeout, part.rank)
    t1 = time.perf_counter()
    phases = {"write": t_written - t0, "sync": t_synced - t_written, "commit": t1 - t_synced}
    return SaveResult(part.step, nbytes, len(written), committed, t1 - t0, phases, started_at)


def _check_abort(abort: threading.Event | None, where: str) -> None:
    if abort is not None and abort.is_set():
        raise SaveAborted(f"{where}: save abandoned after its deadline")


def _write_data(
    store: Store, part: Any, pool: ThreadPoolExecutor, dedupe, to_numpy, where: str, written: list[str], abort
) -> tuple[int, list[str]]:
    """Put every shard and metadata object of ``part`` (not yet durable: one ``sync`` follows;
    on a filesystem that is one syncfs instead of an fsync per file and folder). Appends each
    key to ``written`` before putting it (a failed put may leave it). Returns the bytes written
    and the shard object keys (relative to the step folder) for the done record."""
    folder = mf.step_dir(part.step)
    lock = threading.Lock()

    def put(key: str, data) -> None:
        _check_abort(abort, where)
        with lock:
            written.append(key)
        store.put_deferred(key, data)

    def put_meta(key: str, data: bytes) -> int:
        put(f"{folder}/{key}", data)
        return len(data)

    def put_shard(sw) -> int:
        key = f"{folder}/{sw.object_key}"
        if sw.image is not None:  # staged as the object itself: checksum it in place, send it whole
            data = to_numpy(sw.image)
            seal_image(sw.layout, data, sw.chunks)
        else:
            data = to_numpy(sw.buffer)
        if dedupe is not None:
            digest = dedupe.digest(sw, data)
            _check_abort(abort, where)
            if dedupe.try_reuse(store, sw.object_key, digest, key):
                with lock:
                    written.append(key)
                return 0  # unchanged since the last commit: linked/copied, no bytes written
        bufs = [memoryview(data)] if sw.image is not None else encode_shard(sw.layout, sw.coord, data)
        put(key, bufs)
        return data_size(bufs)

    for key, _ in part.metadata:
        if key == mf.COMMIT or key.startswith((f"{mf.DONE}/", f"{CLAIMS}/")):
            raise CheckpointError(f"{where}: metadata key {key!r} is reserved for the commit protocol")
    futures = [pool.submit(put_meta, k, d) for k, d in part.metadata]
    futures += [pool.submit(put_shard, sw) for sw in part.shards]
    nbytes, err = 0, None
    for f in futures:
        try:
            nbytes += f.result()
        except (StorageError, OSError, ValueError, CheckpointError) as e:
            err = err or e
    if err is not None:
        if isinstance(err, SaveAborted):
            raise err
        raise CheckpointError(f"{where}: rank {part.rank} failed to write its data: {err}") from err
    return nbytes, [sw.object_key for sw in part.shards]


def clean_up(store: Store, where: str, rank: int, keys: list[str]) -> None:
    """Best effort: delete what this rank wrote of a save that failed before its done record
    (a disk-full episode must not leave partial data that blocks the next saves)."""
    failed = 0
    for key in keys:
        try:
            store.delete(key)
        except StorageError:
            failed += 1
    if keys:
        log.warning(
            "%s: rank %d's save failed; deleted %d of the %d objects it wrote",
            where,
            rank,
            len(keys) - failed,
            len(keys),
        )


# ----------------------------------------------------------------------------------- commit


def expected_shards(manifest: mf.Manifest) -> set[str]:
    """Every shard object (key relative to the step folder) the manifest's tensors need: each
    shard of the grid of every array that has data (not empty, not an inline scalar)."""
    out = set()
    for e in manifest.tensors.values():
        lay = e.layout
        if e.value is not None or lay.nbytes == 0:
            continue
        if math.prod(lay.grid_shape) > 1 << 24:
            raise CheckpointError(
                f"array {e.key!r}: {math.prod(lay.grid_shape)} shards is more than a checkpoint can have"
            )
        out.update(f"{e.path}/{lay.shard_key(c)}" for c in lay.shard_coords())
    return out


def _claimed_manifest(store: Store, step: int, attempt: str, world_size: int, where: str) -> tuple[dict, mf.Manifest]:
    """(the owning claim, the manifest) of ``attempt``, which must own the step (newest claim)
    and whose manifest must name the same step, attempt and world size; read under the manifest
    size cap. Raises otherwise."""
    rec = owner(store, step)
    if rec is None or rec.get("attempt") != attempt:
        who = "nobody" if rec is None else f"job {rec.get('writer')!r} (attempt {rec.get('attempt')!r})"
        raise StepClaimed(f"{where}: not committing attempt {attempt}: the step is claimed by {who}")
    try:
        m = mf.Manifest.from_bytes(store.get(f"{mf.step_dir(step)}/{mf.MANIFEST}", limit=mf.MAX_MANIFEST_BYTES), where)
    except NotFoundError:
        raise CheckpointError(f"{where}: not committing attempt {attempt}: manifest.json is missing") from None
    if (m.step, m.attempt, m.world_size) != (step, attempt, world_size):
        raise CheckpointError(
            f"{where}: not committing attempt {attempt} of world size {world_size}: the manifest names step "
            f"{m.step}, attempt {m.attempt!r}, world size {m.world_size}"
        )
    return rec, m


def try_commit(store: Store, step: int, attempt: str, world_size: int, extra: dict | None = None) -> bool:
    """Write the commit record if every rank of ``attempt`` has written its done record.

    Called by each rank (or daemon) after its own done record is durable. Returns True for the
    one caller whose ``put_if_absent`` created the record. Listing after our own done record is
    written guarantees the last finisher sees them all (object stores list what was written).
    Before committing, checks that the step's newest claim, its manifest and the done records
    all name ``attempt``, that the manifest parses and matches the step and world size, and
    that the done records account for every shard the manifest needs; CheckpointError if not
    (nothing is committed)."""
    where = catalog.where(store, step)
    dones = list(store.list(mf.done_prefix(step, attempt)))
    if len(dones) < world_size:
        return False
    rec, m = _claimed_manifest(store, step, attempt, world_size, where)
    total, objects, ranks, shards = 0, 0, set(), set()
    for d in dones:
        try:
            r = mf.read_json(store, d.key, where, "done record")
            ranks.add(r["rank"])
            total += int(r.get("bytes", 0))
            objects += int(r.get("objects", 0))
            shards.update(r.get("shards", ()))
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"{where}: done record {d.key} is malformed ({e!r})") from None
    if ranks != set(range(world_size)):
        raise CheckpointError(f"{where}: done records of attempt {attempt} name ranks {sorted(ranks)[:8]}...")
    missing = expected_shards(m) - shards
    if missing:
        raise CheckpointError(
            f"{where}: not committing attempt {attempt}: no rank wrote {len(missing)} shard objects the manifest "
            f"needs, e.g. {sorted(missing)[0]}"
        )
    record = {
        "step": step,
        "attempt": attempt,
        "writer": rec.get("writer"),
        "world_size": world_size,
        "bytes": total,
        "objects": objects,
        "time": time.time(),
        **(extra or {}),
    }
    return commit_step(store, step, record)


# -- the scalable commit (issue 17): the done tree, the latest-step chain, paced polling ------------


def finish_rank(
    store: Store, step: int, attempt: str, rank: int, world_size: int, record: dict, extra: dict | None = None
) -> bool:
    """Rank's part of the commit, once all its data is durable: :func:`donetree.write_done`
    then :func:`climb`. True for the one caller that created the commit record."""
    donetree.write_done(store, step, attempt, rank, record)
    return climb(store, step, attempt, rank, world_size, extra)


def climb(store: Store, step: int, attempt: str, rank: int, world_size: int, extra: dict | None = None) -> bool:
    """After rank's done record is durable: climb the done tree (``ckptd.donetree``: one LIST of
    at most 64 keys per level, no GET of other ranks' records); the rank that completes it
    checks the step (:func:`_check_before_commit`) and writes ``commit.json`` (with ``extra``)
    through :func:`commit_step`. True for the one caller that created the commit record."""

    def commit(total: donetree.Totals) -> bool:
        rec = _check_before_commit(store, step, attempt, world_size, total)
        won = commit_step(store, step, {**rec, "done_layout": "tree", **(extra or {})})
        if won:
            _write_notices(store, step, attempt, world_size)
        return won

    return donetree.climb(store, step, attempt, rank, world_size, commit)


def _check_before_commit(store: Store, step: int, attempt: str, world_size: int, total) -> dict:
    """What ``try_commit`` checks, from the tree's totals instead of every done record: the
    newest claim and the manifest name ``attempt`` (the tree already holds one record per rank
    0 .. N-1), and the shards the done records name are the ones the manifest needs -- the
    tree sums a 64-bit hash of each rank's shard keys, compared with the same sum over
    ``expected_shards``; only when they differ are the records read to say what is missing
    (a rank may write more than the manifest needs). Returns the commit record."""
    where = catalog.where(store, step)
    rec, m = _claimed_manifest(store, step, attempt, world_size, where)
    expected = expected_shards(m)
    if donetree.shard_digest(expected) != total.digest:
        shards: set[str] = set()
        for info in store.list(f"{mf.step_dir(step)}/{mf.DONE}/{attempt}/t1/"):
            try:
                shards.update(mf.read_json(store, info.key, where, "done record").get("shards", ()))
            except (ValueError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{where}: done record {info.key} is malformed ({e!r})") from None
        missing = expected - shards
        if missing:
            raise CheckpointError(
                f"{where}: not committing attempt {attempt}: no rank wrote {len(missing)} shard objects the "
                f"manifest needs, e.g. {sorted(missing)[0]}"
            )
    return {
        "step": step,
        "attempt": attempt,
        "writer": rec.get("writer"),
        "world_size": world_size,
        "bytes": total.bytes,
        "objects": total.objects,
        "time": time.time(),
    }


def _write_notices(store: Store, step: int, attempt: str, world_size: int) -> None:
    """After the commit: the notices waiting ranks poll above 1024 ranks. A failure only slows
    the waiters down (they also check ``commit.json``), so it never fails the committed save."""
    for key in donetree.notice_keys(step, attempt, world_size):
        try:
            store.put(key, b"{}")
        except StorageError as e:
            log.warning("%s: could not write commit notice %s: %s", store.uri, key, e)
            return


def commit_step(store: Store, step: int, record: dict) -> bool:
    """Create ``commit.json`` once (``put_if_absent``); True for the one caller that created it.

    Every commit goes through here: it links ``step`` into the chain of ``ckptd.latest`` first,
    so that ``catalog.latest_step`` can trust the chain, and moves the chain's hint after."""
    on_chain = False
    try:
        on_chain = latest.link(store, step, catalog.latest_step_by_listing)
    except ValueError as e:  # a malformed chain: readers fall back to listing where they meet it
        log.warning("%s: not linking step %d into the latest-step chain: %s", store.uri, step, e)
    won = store.put_if_absent(f"{mf.step_dir(step)}/{mf.COMMIT}", mf.dumps(record))
    if won and on_chain:
        try:
            latest.set_hint(store, step)
        except StorageError as e:  # only costs later readers a longer walk
            log.warning("%s: could not move the latest-step hint to %d: %s", store.uri, step, e)
    return won


POLLS_PER_SECOND = 2000  # all ranks of a job together, on the one commit.json (S3: 5500/prefix)


def poll_delays(world_size: int, rank: int):
    """The pauses of one rank polling for ``commit.json``: up to 64 ranks, 5 ms doubling to
    50 ms; above, every pause is drawn from [0.5, 1.5) x ``world_size / POLLS_PER_SECOND`` (at
    most 8 s), so that ranks finishing together do not poll in step and the sum over all ranks
    stays near ``POLLS_PER_SECOND`` from the first poll on (a doubling start lets thousands of
    ranks poll at 200/s each at first: 1024 ranks met SlowDowns that way in the simulator)."""
    if world_size <= 64:
        delay = 0.005
        while True:
            yield delay
            delay = min(delay * 2, 0.05)
    mean = min(8.0, world_size / POLLS_PER_SECOND)
    rng = random.Random(rank * 7919 + world_size)
    while True:
        yield mean * (0.5 + rng.random())


def wait_commit(store: Store, step: int, attempt: str, world_size: int, timeout: float, rank: int = 0) -> None:
    """Poll for the commit record of ``step`` (above 1024 ranks, for the commit notice of this
    rank's group: ``donetree.notice_keys``); CheckpointError after ``timeout`` seconds, naming
    how many ranks finished. Paced by :func:`poll_delays`: the ranks polling one key together
    stay near ``POLLS_PER_SECOND`` existence checks (an S3 prefix serves ~5500)."""
    deadline = time.monotonic() + timeout
    notices = donetree.notice_keys(step, attempt, world_size)
    # Above 1024 ranks a rank polls its group's notice, paced for the group, and each poll is
    # of commit.json itself with probability NOTICE_GROUP / N (in case the committer died
    # before the notices): commit.json's prefix then sees about POLLS_PER_SECOND in all. A
    # random choice, not every k-th poll: ranks that finished together would poll in step.
    notice = notices[min(rank // donetree.NOTICE_GROUP, len(notices) - 1)] if notices else None
    delays = poll_delays(donetree.NOTICE_GROUP if notice else world_size, rank)
    pick = random.Random(rank * 104729 + step)
    if world_size > 64:  # it has just found the done tree incomplete: no commit yet, and
        time.sleep(next(delays))  # thousands of ranks finishing together must not HEAD at once
    while True:
        if notice is None or pick.random() < donetree.NOTICE_GROUP / world_size:
            rec = catalog.read_commit(store, step)  # one GET: exists, and by whom
            if rec is not None:
                if rec.get("attempt") != attempt:
                    raise CheckpointError(
                        f"{catalog.where(store, step)}: committed by attempt {rec.get('attempt')!r}, not {attempt}"
                    )
                return
        elif store.exists(notice):  # under _done/<attempt>/: only this attempt's committer writes it
            return
        if time.monotonic() > deadline:
            n = donetree.count_done(store, step, attempt)
            raise CheckpointError(
                f"{catalog.where(store, step)}: not committed after {timeout:.0f} s: {n} of {world_size} ranks finished"
            )
        time.sleep(next(delays))


def check_consistency(store: Store, step: int, manifest: mf.Manifest) -> list[str]:
    """What ``ckptd verify`` checks of the commit protocol on a committed step: the commit
    record, the manifest, the newest claim (where the step has claims: checkpoints written
    before claims existed have none) and the done records all name one attempt."""
    where = catalog.where(store, step)
    errors = []
    rec = catalog.read_commit(store, step) or {}
    attempt = rec.get("attempt")
    if manifest.attempt and attempt != manifest.attempt:
        errors.append(f"{where}: commit.json names attempt {attempt!r} but manifest.json {manifest.attempt!r}")
    cs = claims(store, step)
    if cs and cs[-1][1].get("attempt") != attempt:
        errors.append(
            f"{where}: commit.json names attempt {attempt!r} but the step is claimed by "
            f"{cs[-1][1].get('writer')!r} attempt {cs[-1][1].get('attempt')!r}"
        )
    ws = rec.get("world_size")
    if attempt is not None and isinstance(ws, int):
        n = donetree.count_done(store, step, attempt)
        if n != ws:
            errors.append(f"{where}: {n} done records for attempt {attempt!r}, world size {ws}")
    return errors


# -------------------------------------------------------------------------------- retention


def after_commit(store: Store, result: SaveResult, keep_last: int | None) -> None:
    """The one retention convention: the writer that wrote the commit record applies retention,
    after it has reported the commit (so retention delays neither the caller nor the result).

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
        deleted = catalog.retain(store, keep_last)
        if deleted:
            log.info("retention removed steps %s", deleted)
    except (CheckpointError, StorageError) as e:
        log.warning("retention failed: %s", e)


# ------------------------------------------------------------------------- incremental saves


class Dedupe:
    """Content hashes (sha256 of each shard's data) of the last committed save of this writer.

    Exact reuse needs a strong hash: a collision would silently keep stale data, so no crc.
    Hashing costs ~1.5 GB/s per core in the background writer, which is why it is opt-in.
    """

    def __init__(self):
        self._committed: dict[str, tuple[int, str]] = {}  # object key -> (step, digest)
        self._pending: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self.reused = 0

    def digest(self, sw, data: np.ndarray) -> str:
        h = hashlib.sha256(repr(sw.layout).encode())  # dtype, shapes, chunking
        h.update(memoryview(data.reshape(-1).view("u1")))
        d = h.hexdigest()
        with self._lock:
            self._pending[sw.object_key] = (-1, d)
        return d

    def try_reuse(self, store: Store, object_key: str, digest: str, dst: str) -> bool:
        prev = self._committed.get(object_key)
        if prev is None or prev[1] != digest:
            return False
        try:
            store.copy(f"{mf.step_dir(prev[0])}/{object_key}", dst)
        except StorageError:  # the previous checkpoint was deleted (retention): write it again
            return False
        with self._lock:
            self.reused += 1
        return True

    def committed(self, step: int) -> None:
        with self._lock:
            self._committed = {k: (step, d) for k, (_, d) in self._pending.items()}
            self._pending = {}

    def failed(self) -> None:
        with self._lock:
            self._pending = {}


__all__ = [
    "AlreadyCommitted",
    "Dedupe",
    "SaveAborted",
    "StepClaimed",
    "POLLS_PER_SECOND",
    "check_consistency",
    "climb",
    "commit_step",
    "finish_rank",
    "follow_claim",
    "SharedClaim",
    "trusted",
    "lead_claim",
    "outcome_key",
    "outcome_keys",
    "poll_delays",
    "clean_up",
    "claims",
    "expected_shards",
    "owner",
    "reclaim",
    "SaveResult",
    "after_commit",
    "apply_retention",
    "sweep_leftovers",
    "begin",
    "manifest_objects",
    "persist",
    "try_commit",
    "wait_commit",
]
