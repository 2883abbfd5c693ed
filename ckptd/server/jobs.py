"""Handed-off snapshots: upload them with the one commit protocol, watch their commits.

A job (``handoff.Job``) is one rank's part of one checkpoint, its buffers in files of a staging
lease, written by ``ckptd.persist.persist`` as the in-process writer writes it (docs/architecture.md,
"Who calls ``persist``"). The step is claimed once per attempt for all the ranks the daemon serves
(``server.shared_claim.SharedClaim``; ``ckptd_step_claims_total``), not once per job.

States: ``queued`` -> ``uploading`` -> ``uploaded`` (this rank's data and done record are durable;
other ranks still to finish) -> ``committed``; or ``failed``; or ``discarded`` (at restart, when
its files did not survive). Upload concurrency is bounded by ``upload_workers`` jobs and
``io_threads`` puts; commits of ``uploaded`` jobs are watched by one thread, so no upload worker
sits idle waiting for other nodes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import catalog, claims, donetree, leases, persist, retention
from ckptd.commit import PACED_ABOVE, POLLS_PER_SECOND
from ckptd.errors import AlreadyCommitted, CheckpointError, SaveAborted, StepClaimed
from ckptd.persist import SaveResult
from ckptd.server.handoff import FINAL, JOB_ID, BadJob, Job, intact, load, validate
from ckptd.server.metrics import Metrics
from ckptd.server.roots import RootError, Roots
from ckptd.server.settings import Settings
from ckptd.server.shared_claim import SharedClaim
from ckptd.server.staging import Lease, LeaseBusy, Staging
from ckptd.server.tiers import origin_of
from storage_backends import StorageError, Store
from storage_backends.base import data_size

__all__ = ["Runner"]

log = logging.getLogger("ckptd.jobs")


class _Counted:
    """Counts the bytes of every put into ``job.bytes_uploaded``, for the status page's progress."""

    def __init__(self, store: Store, job: Job, tee: Callable | None = None):
        self._store, self._job = store, job
        self._tee = tee  # the memory tier's copy of each put (``server.tiers``), or None
        self._lock = threading.Lock()  # puts run on the io pool: ``+=`` alone would lose updates

    def _counted(self, put: Callable, key, data):
        tag = put(key, data)
        with self._lock:
            self._job.bytes_uploaded += data_size(data)
        if self._tee is not None:
            self._tee(key, data)
        return tag

    def __getattr__(self, name):  # put, put_deferred and put_new are counted; the rest is the store's
        attr = getattr(self._store, name)
        return functools.partial(self._counted, attr) if name in ("put", "put_deferred", "put_new") else attr


class Runner:
    """Accepts jobs, uploads them on a bounded pool and watches their commits."""

    HISTORY = 4096  # finished jobs remembered for status queries

    def __init__(self, settings: Settings, roots: Roots, staging: Staging, metrics: Metrics):
        self.settings = settings
        self.roots = roots
        self.staging = staging
        self.metrics = metrics
        self.tiers: Any = None  # ``server.tiers.Tiers`` (set by create_app)
        # who the files written into a root belong to (``Tenancy.owner_of``; set by create_app)
        self.owner_of: Callable[[str], tuple[int, int] | None] = lambda root: None
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._stores: dict[str, Store] = {}
        self._pool = ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="ckptd-upload")
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="ckptd-io")
        # one claim of a step per attempt for all the ranks this daemon serves (not one per job)
        self._claims = SharedClaim(on_begin=lambda: metrics.inc("ckptd_step_claims_total"))
        self._watching: dict[str, float] = {}  # job id -> next check (monotonic)
        self._on_final: dict[str, list[Callable[[], None]]] = {}  # job id -> long polls waiting
        self._stop = threading.Event()
        self._pending = 0  # queued or running
        self._running = 0
        self._thread = threading.Thread(target=self._loop, name="ckptd-watch", daemon=True)
        self._thread.start()
        # Its own thread: a slow listing of a big bucket must not delay commit watching.
        threading.Thread(target=self._housekeeping, name="ckptd-housekeeping", daemon=True).start()

    # ----------------------------------------------------------------------------- public

    def store(self, root: str) -> Store:
        with self._lock:
            st = self._stores.get(root)
            if st is None:
                st = self._stores[root] = self.roots.open_store(root, lambda: self.owner_of(root))
            return st

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def on_final(self, job_id: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Have ``callback`` called (once, from the thread that finishes the job) when job
        ``job_id`` reaches a final state; returns a function that cancels it. Long polls wait on
        this instead of checking the job's state in a loop. The caller checks the state after
        subscribing: a job final before that is never notified."""
        with self._lock:
            self._on_final.setdefault(job_id, []).append(callback)

        def cancel() -> None:
            with self._lock:
                waiting = self._on_final.get(job_id)
                if waiting is not None and callback in waiting:
                    waiting.remove(callback)
                    if not waiting:
                        del self._on_final[job_id]

        return cancel

    def _notify_final(self, job_id: str) -> None:
        with self._lock:
            callbacks = self._on_final.pop(job_id, [])
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a waiter that went away must not fail the job
                log.debug("job %s: a status waiter failed", job_id, exc_info=True)

    def recent(self, limit: int = 100) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())[-limit:]

    @property
    def queue_depth(self) -> int:
        """Jobs accepted whose upload has not finished."""
        with self._lock:
            return self._pending

    @property
    def watching(self) -> int:
        with self._lock:
            return len(self._watching)

    def accept(self, req: dict) -> Job:
        """Validate a hand-off, journal it and queue its upload. From the return on, the
        daemon owns the files: the client may die."""
        lease = self.staging.get(req["lease"])
        job_id = req.get("job")
        if job_id is not None:
            if not JOB_ID.match(job_id):
                raise BadJob(f"invalid job id {job_id!r}")
            known = self.get(job_id)
            if known is not None:  # the client retried a hand-off that had gone through
                if known.lease != lease.id:
                    raise BadJob(f"job id {job_id} is already taken")
                return known
        if lease.owner != "client":
            raise LeaseBusy(f"lease {lease.id} already carries job {lease.job}")
        job = validate(req, lease, self.roots, job_id)
        self._refuse_committed(job)
        job.staged_s = max(0.0, job.accepted_at - lease.started_at)
        self.staging.hand_off(lease.id, job.job, job.journal() | {"state": "accepted"})
        self._remember(job)
        self.metrics.inc("ckptd_jobs_accepted_total")
        self.metrics.inc("ckptd_save_staging_seconds_sum", job.staged_s)
        self.metrics.inc("ckptd_save_staging_seconds_count")
        log.info("accepted job %s: %s step %d rank %d/%d", job.job, job.root, job.step, job.rank, job.world_size)
        self._enqueue(job)
        return job

    def _refuse_committed(self, job: Job) -> None:
        """A committed checkpoint is immutable: refuse a hand-off for its step (HTTP 409) before
        the daemon takes the files or writes a byte. (The upload's claim checks again.)"""
        try:  # one read for the daemon's jobs of the step handed off together
            committed = self._claims.committed(self.store(job.root), job.root, job.step) is not None
        except StorageError as e:
            raise BadJob(f"{job.root}: cannot check step {job.step} ({e})") from None
        except CheckpointError:  # a malformed commit record: the step has one all the same
            committed = True
        if committed:
            raise AlreadyCommitted(
                f"{catalog.where(self.store(job.root), job.step)}: step {job.step} is already committed; "
                "refusing the hand-off"
            )
        try:  # an absurd step would count as the newest for retention (issue 26 part 2)
            retention.check_step_jump(self.store(job.root), job.step, self.settings.max_step_jump or None)
        except StorageError as e:
            raise BadJob(f"{job.root}: cannot check step {job.step} ({e})") from None
        except CheckpointError as e:
            raise BadJob(str(e)) from None

    def recover(self) -> None:
        """Resume or discard what a previous daemon journalled in the staging folder."""
        for lease, rec in self.staging.recover():
            if rec is None:
                continue
            try:
                job = Job(**{k: v for k, v in rec.items() if k in Job.__dataclass_fields__})
            except TypeError as e:
                log.warning("staging lease %s: unreadable job journal (%s); freeing it", lease.id, e)
                self.staging.discard(lease.id)
                continue
            try:
                self.roots.check(job.root)
            except RootError as e:
                # Another daemon's entry (a staging folder shared by daemons of other roots):
                # never uploaded, shown or freed here; its own daemon resumes it.
                log.warning(
                    "staging lease %s: leaving job %s of another root alone (%s): %s", lease.id, job.job, job.where, e
                )
                self.staging.leave(lease.id)
                continue
            if rec.get("state") == "accepted":
                self._recover_accepted(job, lease)
                continue
            self._remember(job)
            if rec.get("state") == "uploaded":
                self._watch(job)

    def close(self, grace_s: float = 30.0) -> None:
        """Stop: finish running uploads for up to ``grace_s``; what is left resumes at restart."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        while self._running and time.monotonic() < deadline:
            time.sleep(0.05)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=2)
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for st in stores:
            with contextlib.suppress(Exception):
                st.close()

    # ------------------------------------------------------------------------ internals

    def _remember(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.job] = job
            self._jobs.move_to_end(job.job)
            while len(self._jobs) > self.HISTORY and next(iter(self._jobs.values())).state in FINAL:
                self._jobs.popitem(last=False)  # the oldest, once final

    def _enqueue(self, job: Job) -> None:
        with self._lock:
            self._pending += 1
        self._pool.submit(self._run, job)

    def _recover_accepted(self, job: Job, lease: Lease) -> None:
        why = intact(job, lease.dir) or self._superseded(job)  # recover() checked the root
        if why is None:
            log.warning("resuming job %s after a restart: %s (its staged files are intact)", job.job, job.where)
            job.state = "queued"
            self._remember(job)
            self.metrics.inc("ckptd_jobs_recovered_total")
            self._enqueue(job)
            return
        log.warning("discarding job %s after a restart: %s: %s", job.job, job.where, why)
        job.state, job.error = "discarded", f"discarded after a daemon restart: {why}"
        job.finished_at = time.time()
        self._remember(job)
        self.metrics.inc("ckptd_jobs_discarded_total")
        self.staging.discard(lease.id)

    def _superseded(self, job: Job) -> str | None:
        """Why a journalled job must not be finished: its step committed by another attempt, a
        newer attempt of the same step started (its shards would overwrite that attempt's), or
        the root committed a newer step since (issue 28 item 3: the step was saved again and then
        deleted by retention, or was abandoned; a partial older than the newest commit can no
        longer complete, as ``ckptd.retention`` assumes, so resuming it would only resurrect a
        deleted step as a partial)."""
        try:
            store = self.store(job.root)
            commit = catalog.read_commit(store, job.step)
            if commit is not None:
                return None if commit.get("attempt") == job.attempt else "the step was committed by another attempt"
            if donetree.attempts(store, job.step) - {job.attempt}:
                return "a newer attempt of the same step has started"
            newest = catalog.latest_step_by_listing(store)  # not the _latest hint: rare, and exact
            if newest is not None and newest > job.step:
                return (
                    f"the root has committed step {newest} since (step {job.step} was saved again and deleted, "
                    "or can no longer complete)"
                )
        except (StorageError, CheckpointError) as e:
            return f"cannot check its checkpoint folder ({e})"
        if time.time() - job.accepted_at > job.commit_timeout:
            return f"accepted more than its commit timeout ({job.commit_timeout:.0f} s) ago"
        return None

    def _run(self, job: Job) -> None:
        with self._lock:
            self._running += 1
        try:
            self._upload(job)
        except Exception as e:  # noqa: BLE001 - a job's failure must never kill the worker
            if self._stop.is_set():
                log.warning("job %s interrupted by shutdown; a restart resumes it", job.job)
            else:
                log.exception("job %s failed unexpectedly", job.job)
                self._finish(job, "failed", f"internal error: {e!r}")
        finally:
            with self._lock:
                self._pending -= 1
                self._running -= 1

    def _upload(self, job: Job) -> None:
        """Upload ``job``, then record the outcome: failed, or uploaded (:meth:`_uploaded`)."""
        lease = self.staging.get(job.lease)
        if job.memory_only:
            self._hold(job, lease)
            return
        if self.tiers is not None:  # a step the job persists after all: its memory-only room is not needed
            self.tiers.release_reservation(job.root, job.step, job.attempt, job.rank)
        job.state = "uploading"
        job.upload_started_at, job.bytes_uploaded = time.time(), 0
        on = self.tiers is not None and self.tiers.enabled
        tee = self.tiers.recorder(job.root, job.step, job.attempt, job.rank, origin=origin_of(job.uid)) if on else None
        store: Any = _Counted(self.store(job.root), job, tee)
        result, err = self._upload_with_retries(job, store, lease)
        if result is None:
            if self._stop.is_set() and err is None:
                return  # shutting down: the journal still says accepted; a restart resumes it
            job.error_kind = type(err).__name__ if type(err).__name__ in claims.REFUSALS else None
            if job.error_kind is None and not isinstance(err, SaveAborted):  # ours (past the deadline: given up)
                leases.abandon(self.store(job.root), job.step, job.attempt)
            job.lease_kept = self.staging.uploaded(job.lease, job.journal() | {"state": "failed", "error": str(err)})
            self._finish(job, "failed", str(err))
            return
        self._uploaded(job, store, result)

    def _hold(self, job: Job, lease: Lease) -> None:
        """A memory-only step's part: written by the one write path into the memory tier
        (``server.tiers``: the upload tee, one copy into sealed memory), never uploaded."""
        job.state = "uploading"
        t = self.tiers
        try:
            if t is None or not t.enabled:
                raise CheckpointError("this daemon keeps no memory tier (--no-tiers): memory-only steps are refused")
            t.backpressure(job.root, job.step, job.rank, job.accepted_at + job.commit_timeout)
            store = t.holder(job.root, job.step, job.attempt, job.rank, origin_of(job.uid))
            part = load(job, lease.dir)
            try:
                writer = job.writer or job.attempt
                persist.persist(store, part, self._io, writer=writer, wait=False, claim="caller", heartbeat=False)
            except CheckpointError:
                # A job of one rank completes its done tree at once and its commit rules find no
                # claim (none is made in memory): its done record is written all the same.
                if job.world_size != 1:
                    raise
            finally:
                del part  # unmap the staging files
            t.held(job.root, job.step, job.attempt, job.rank)
        except (OSError, CheckpointError) as e:
            if t is not None:
                t.release_reservation(job.root, job.step, job.attempt, job.rank)
                t.failed(job.root, job.step, job.attempt, job.rank)
            job.lease_kept = self.staging.uploaded(job.lease, job.journal() | {"state": "failed", "error": str(e)})
            self._finish(job, "failed", f"memory-only step: {e}")
            return
        job.lease_kept = self.staging.uploaded(job.lease, job.journal() | {"state": "held"})
        self._finish(job, "held")

    def _upload_with_retries(
        self, job: Job, store: Any, lease: Lease
    ) -> tuple[SaveResult | str | None, BaseException | None]:
        """Check the step is not committed (one read shared with the node's other jobs), claim
        it (shared), then ``persist`` this rank's part, up to ``upload_retries`` more times after
        a transient failure. Returns (the SaveResult, "already" when a restart finds its own
        attempt committed, or None; the last error)."""
        commit = self._claims.committed(store, job.root, job.step)  # shared with the node's other jobs
        result: SaveResult | str | None = None
        err: BaseException | None = None
        tries = self.settings.upload_retries + 1
        if commit is not None and commit.get("attempt") == job.attempt:
            result = "already"  # a restart after the commit but before the journal said so
        elif commit is not None:  # refused here: on a shared go (no begin of its own) it would write
            tries = 0
            err = AlreadyCommitted(
                f"{catalog.where(store, job.step)}: step {job.step} was committed by attempt "
                f"{commit.get('attempt')!r}; refusing to overwrite"
            )
        abort = threading.Event()  # the trainer gives the job up commit_timeout after the hand-off: so do we

        def give_up() -> None:  # at once, even while a put of this job is stuck in a storage call
            abort.set()
            leases.abandon(self.store(job.root), job.step, job.attempt)

        timer = threading.Timer(max(0.0, job.accepted_at + job.commit_timeout - time.time()), give_up)
        timer.daemon = True
        timer.start()
        for attempt in range(tries):
            if result is not None or self._stop.is_set():
                break
            t0 = time.perf_counter()
            job.bytes_uploaded = 0  # a retry puts everything again
            try:
                # The attempt's first job here runs begin; its other jobs wait for that running
                # claim (never for a queued job) and share a definitive outcome.
                writer = claims.check_writer(job.writer or job.attempt)
                self._claims.claim(store, job.root, job.step, job.attempt, writer)
                save_job = load(job, lease.dir)
                try:
                    result = persist.persist(
                        store,
                        save_job,
                        self._io,
                        writer=writer,
                        commit_timeout=job.commit_timeout,
                        abort=abort,
                        wait=False,
                        claim="caller",
                    )
                finally:
                    del save_job  # unmap the staging files
            except (OSError, CheckpointError, StorageError) as e:
                err = e
                if isinstance(e, SaveAborted):  # said as the commit watch says it
                    err = SaveAborted(f"not committed {job.commit_timeout:.0f} s after hand-off")
                if isinstance(e, AlreadyCommitted | StepClaimed | SaveAborted):
                    break  # a refusal, or past the deadline: a retry cannot change that
                if isinstance(e, OSError | CheckpointError) and intact(job, lease.dir) is not None:
                    break  # the files are gone: retrying cannot help
                if attempt < self.settings.upload_retries:
                    self.metrics.inc("ckptd_upload_retries_total")
                    job.retries += 1
                    log.warning("job %s: upload failed (%s); retrying", job.job, e)
                    time.sleep(min(0.5 * 2**attempt, 5.0))
            finally:
                job.upload_seconds += time.perf_counter() - t0
        timer.cancel()
        return result, err

    def _uploaded(self, job: Job, store: Any, result: SaveResult | str) -> None:
        """This rank's data and done record are durable: count them, journal the job uploaded,
        then finish it committed (and apply retention, if this job wrote the commit record) or
        hand it to the commit watch (:meth:`_loop`)."""
        job.uploaded_at = time.time()
        if isinstance(result, SaveResult):
            job.bytes_written, job.objects_written = result.bytes_written, result.objects_written
            job.committed_here = result.committed_here
            self.metrics.inc("ckptd_bytes_written_total", result.bytes_written)
            self.metrics.inc("ckptd_objects_written_total", result.objects_written)
            self.metrics.inc("ckptd_upload_seconds_total", job.upload_seconds)
            if job.upload_seconds > 0:
                self.metrics.set_last(
                    "ckptd_upload_throughput_bytes_per_second", result.bytes_written / job.upload_seconds
                )
            if result.committed_here:
                self.metrics.inc("ckptd_commits_written_total")
        job.lease_kept = self.staging.uploaded(job.lease, job.journal() | {"state": "uploaded"})
        if not isinstance(result, SaveResult) or result.committed_here:
            self._claims.saw_commit(job.root, job.step, {"attempt": job.attempt})
            self._finish(job, "committed")
            if isinstance(result, SaveResult):
                retention.after_commit(store, result, self.settings.keep_last, self.settings.max_step_jump or None)
        else:
            self._watch(job)

    def _watch(self, job: Job) -> None:
        """Hand an uploaded job to the commit watch (:meth:`_loop`)."""
        job.state = "uploaded"
        with self._lock:
            self._watching[job.job] = 0.0

    def _finish(self, job: Job, state: str, error: str | None = None) -> None:
        job.finished_at = time.time()  # before the state: a final status has it
        if state == "committed":
            job.committed_at = job.finished_at
        job.state, job.error = state, error
        if self.tiers is not None and self.tiers.enabled and not job.memory_only:  # the hot copy: kept on commit
            (self.tiers.committed if state == "committed" else self.tiers.failed)(job.root, job.step, job.attempt)
        self._notify_final(job.job)
        if state == "held":  # counted by ``server.tiers`` (ckptd_tier_parts_held_total)
            log.debug("job %s: %s held in memory", job.job, job.where)
        elif state == "committed":
            self.metrics.inc("ckptd_jobs_committed_total")
            took = job.committed_at - job.accepted_at
            self.metrics.inc("ckptd_handoff_to_commit_seconds_sum", took)
            self.metrics.inc("ckptd_handoff_to_commit_seconds_count")
            self.metrics.set_last("ckptd_last_commit_timestamp_seconds", job.committed_at)
            log.info("job %s: %s step %d committed, %.3f s after hand-off", job.job, job.root, job.step, took)
        else:
            self.metrics.inc("ckptd_jobs_failed_total")
            log.error("job %s: %s failed: %s", job.job, job.where, error)
        self.staging.journal(job.lease, job.job, job.journal())

    def _loop(self) -> None:
        """Watch commits of uploaded jobs; expire abandoned leases.

        The jobs of one (root, step, attempt) -- a node's ranks -- share one read of the commit
        record per check, and their checks are paced like the in-process ranks' polls
        (``commit.POLLS_PER_SECOND`` over all the attempt's ranks, above ``commit.PACED_ABOVE``
        ranks): every daemon checking each of its jobs every 20-500 ms made ~N reads per 20 ms
        on one prefix at N ranks."""
        next_expire = 0.0
        rng = random.Random()
        while not self._stop.wait(0.02):
            now = time.monotonic()
            if now >= next_expire:
                self.staging.expire()
                next_expire = now + min(5.0, self.staging.ttl / 4)
            with self._lock:
                for job_id in [i for i in self._watching if i not in self._jobs]:
                    del self._watching[job_id]
                watched = [(self._jobs[i], t) for i, t in self._watching.items()]
            due = {(j.root, j.step, j.attempt) for j, t in watched if t <= now}
            groups: dict[tuple, list[Job]] = {}
            for j, _ in watched:
                if (j.root, j.step, j.attempt) in due:
                    groups.setdefault((j.root, j.step, j.attempt), []).append(j)
            for (root, step, _), jobs in groups.items():
                try:
                    commit = catalog.read_commit(self.store(root), step)
                except (StorageError, CheckpointError) as e:
                    log.warning("%s step %d: cannot check its commit (%s)", root, step, e)
                    commit = None
                final = {job.job for job in jobs if self._check_commit(job, commit)}
                left = [job for job in jobs if job.job not in final]
                with self._lock:
                    for job_id in final:
                        self._watching.pop(job_id, None)
                if not left:
                    continue
                waited = time.time() - min(j.uploaded_at or j.accepted_at for j in left)
                pause = min(0.01 + waited / 10, 0.5)
                world = left[0].world_size
                if world > PACED_ABOVE:  # all the attempt's daemons together: ~POLLS_PER_SECOND reads
                    pause = max(pause, world / len(left) / POLLS_PER_SECOND * (0.5 + rng.random()))
                with self._lock:
                    for job in left:
                        if job.job in self._watching:
                            self._watching[job.job] = now + pause

    def _housekeeping(self) -> None:
        """Abort the incomplete multipart uploads under every served root that are older than
        ``abort_uploads_older_than_s`` (those of killed writers, and the orphans a lost
        CreateMultipartUpload response leaves), every ``housekeeping_interval_s``. The first
        sweep runs one interval after start."""
        while not self._stop.wait(self.settings.housekeeping_interval_s):
            for root in self.roots.uris:
                try:
                    aborted = self.store(root).abort_stale_uploads(self.settings.abort_uploads_older_than_s)
                except (StorageError, ValueError) as e:
                    log.warning("housekeeping of %s failed: %s", root, e)
                    continue
                if aborted:
                    self.metrics.inc("ckptd_uploads_aborted_total", len(aborted))
                    log.info("housekeeping of %s: aborted %d incomplete uploads", root, len(aborted))

    def _check_commit(self, job: Job, commit: dict | None) -> bool:
        """Finish ``job`` if ``commit`` (its step's commit record, None: not there or not
        readable) or its deadline says so; True when it is final."""
        if commit is not None:
            self._claims.saw_commit(job.root, job.step, commit)
            if commit.get("attempt") == job.attempt:
                self._finish(job, "committed")
            else:
                self._finish(job, "failed", f"step {job.step} was committed by another attempt")
            return True
        if time.time() - job.accepted_at > job.commit_timeout:
            self._finish(job, "failed", f"not committed {job.commit_timeout:.0f} s after hand-off")
            return True
        return False
