"""The in-process writer: one background thread that runs the commit protocol
(:mod:`ckptd.persist`) for each snapshot of this rank, in submission order.

The training thread hands a ``SaveJob`` to :meth:`BackgroundWriter.submit` and gets a future
that resolves at the commit (or fails with the save's error); everything that talks to storage
-- the claim of the step, the check that it is not committed, the data, the commit, cleanup of
this job's failed saves and retention -- runs on the writer's threads, never the caller's.

Deadline: ``save_timeout`` counts from ``submit`` (the caller's ``save``) to the future's
outcome, time in the queue included. Each save runs on a thread of its own that the writer
waits for until that deadline; a watchdog fails the future at the deadline even if the save has
not started yet (it then never starts). Past the deadline the save's future fails ("storage did
not answer") and the save is aborted: if its thread ever gets an answer from storage, it writes
nothing more, and neither a done record nor a commit, so the buffers the caller reuses for the
next snapshot can never be committed half-overwritten. A save that failed or was abandoned gives
its claim on the step up (``ckptd.leases.abandon``; its heartbeat stops at the abort), so another
job takes the step at once instead of being refused while the stuck thread lives. A thread
stuck in a storage call stays stuck until that call's own timeout (S3: ``CKPTD_S3_*_TIMEOUT``);
the writer does not wait for it.

After a commit (``retention.after_commit``: the sweep of the committed step, retention) runs on a
thread of its own, never the writer's: storage that stalls after a commit must not hold the next
save in the queue, where no deadline would apply. At most one such thread runs at a time: a
commit that finds it busy queues its result, and the thread, once done, takes every queued
result (each step's sweep, then retention once, for the newest), so ``keep_last`` always holds
once the store answers and a stalled store never piles threads up. At most ``AFTER_QUEUE``
results wait; past that the oldest one's sweep is dropped with a warning (retention still runs
for a newer one; ``gc`` and the daemon's housekeeping abort stale uploads it would have).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from ckptd import catalog, claims, leases, persist, retention
from ckptd.errors import AlreadyCommitted, CheckpointError, StepClaimed
from ckptd.savejob import SaveJob
from storage_backends import Store
from trainer_hooks.flatten import as_numpy
from trainer_hooks.snapshot import Stager

__all__ = ["BackgroundWriter"]

log = logging.getLogger("ckptd.writer")

AFTER_QUEUE = 8  # committed results waiting for their sweep and retention while one runs


class BackgroundWriter:
    """One thread that persists jobs in submission order, fanning puts out on an I/O pool.

    ``writer`` is the job id that claims each step (``ckptd.claims.begin``; ``Checkpointer``
    passes its ``job_id``)."""

    def __init__(
        self,
        store: Store,
        io_pool: ThreadPoolExecutor,
        keep_last: int | None,
        commit_timeout: float,
        incremental: bool = False,
        *,
        writer: str | None = None,
        save_timeout: float = 1800.0,
    ):
        self.store = store
        self.io = io_pool
        self.keep_last = keep_last
        self.commit_timeout = commit_timeout
        self.save_timeout = save_timeout
        self.writer = writer or uuid.uuid4().hex  # a job of its own when not told
        self.dedupe = persist.Dedupe() if incremental else None
        self._lock = threading.Lock()
        self._failed: list[tuple[int, str]] = []  # (step, attempt) of failed saves: reclaimed at the next save
        self._abandoned: list[tuple[int, threading.Thread]] = []  # saves past their deadline
        self._giving_up: list[threading.Thread] = []  # failed saves' leases.abandon, in flight
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckptd-writer")
        self._after: threading.Thread | None = None  # the thread running after_commit, if any
        self._after_queue: list = []  # results waiting for it (under _lock)
        self.max_step_jump: int | None = -1  # retention's bound (Checkpointer sets it; -1: the default)

    def stager(self) -> Stager:
        return Stager()

    def submit(self, job: SaveJob) -> Future:
        """The future resolves at the commit, or fails at the latest ``save_timeout`` seconds
        from now; retention runs after the commit on a thread of its own (``after_commit``)."""
        fut: Future = Future()
        slot = {"state": "queued"}  # "queued" -> "running" (writer) or "expired" (watchdog)
        watchdog = threading.Timer(self.save_timeout, self._expire, (job, fut, slot))
        watchdog.daemon = True
        watchdog.start()
        self._thread.submit(self._persist, job, fut, time.monotonic() + self.save_timeout, slot, watchdog)
        return fut

    def _timeout_error(self, step: int) -> CheckpointError:
        return CheckpointError(
            f"{catalog.where(self.store, step)}: save did not finish within {self.save_timeout:g} s "
            "(save_timeout): storage did not answer; the step is abandoned and will not commit"
        )

    def _expire(self, job: SaveJob, fut: Future, slot: dict) -> None:
        """The watchdog: a save still queued at its deadline fails and never starts. (A running
        one is failed by ``_persist``, which waits for it until the same deadline.)"""
        with self._lock:
            if slot["state"] != "queued":
                return
            slot["state"] = "expired"
        if fut.set_running_or_notify_cancel():
            fut.set_exception(self._timeout_error(job.step))

    def _persist(self, job: SaveJob, fut: Future, deadline: float, slot: dict, watchdog: threading.Timer) -> None:
        watchdog.cancel()
        with self._lock:
            if slot["state"] != "queued":
                return  # expired in the queue: nothing of it was written
            slot["state"] = "running"
        if not fut.set_running_or_notify_cancel():
            return
        # The caller submits only after the collective of save(), which every rank reaches
        # after its previous save ended: no rank of this job still writes the failed steps.
        failed, self._failed = [(s, a) for s, a in self._failed if s != job.step], []
        giving_up, self._giving_up = [t for t in self._giving_up if t.is_alive()], []
        self._abandoned = [(s, t) for s, t in self._abandoned if t.is_alive()]
        if any(s == job.step for s, _ in self._abandoned):
            # Its late puts could land over this attempt's: refuse rather than risk a mix.
            fut.set_exception(
                CheckpointError(
                    f"{catalog.where(self.store, job.step)}: an abandoned save of step {job.step} is still "
                    "inside a storage call; save a later step"
                )
            )
            return
        abort = threading.Event()
        box: dict = {}

        def run() -> None:  # everything that talks to storage, under the save's deadline
            try:
                if failed:
                    for g in giving_up:  # its record lands before the folder goes, never after
                        g.join()
                    claims.reclaim(self.store, [s for s, _ in failed], self.writer, {a for _, a in failed})
                box["result"] = persist.persist(
                    self.store,
                    job,
                    self.io,
                    writer=self.writer,
                    commit_timeout=self.commit_timeout,
                    dedupe=self.dedupe,
                    to_numpy=as_numpy,
                    abort=abort,
                )
            except BaseException as e:  # noqa: BLE001 - handed to the future
                box["error"] = e

        t = threading.Thread(target=run, name=f"ckptd-save-{job.step}", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            abort.set()
            self._abandoned.append((job.step, t))
            box["error"] = self._timeout_error(job.step)
        err = box.get("error")
        if err is not None:
            if self.dedupe is not None:
                self.dedupe.failed()
            if not isinstance(err, AlreadyCommitted | StepClaimed):
                self._failed.append((job.step, job.attempt))  # not ours to reclaim otherwise
                # Let go of the step now, not a lease later (its heartbeat stopped with the save
                # or at the abort): from a thread, as storage may be what stalled the save.
                g = threading.Thread(
                    target=leases.abandon, args=(self.store, job.step, job.attempt), name="ckptd-give-up", daemon=True
                )
                g.start()
                self._giving_up.append(g)
            fut.set_exception(err)
            return
        result = box["result"]
        if self.dedupe is not None:
            self.dedupe.committed(job.step)
        fut.set_result(result)
        self._after_commit(result)

    def _after_commit(self, result) -> None:
        """``retention.after_commit`` off the writer's path: queued for the one after-commit
        thread, started here if it is not running."""
        if not result.committed_here:
            return
        with self._lock:
            self._after_queue.append(result)
            if len(self._after_queue) > AFTER_QUEUE:
                dropped = self._after_queue.pop(0)
                log.warning(
                    "%s: the sweep and retention after earlier commits are still running (storage slow or "
                    "stalled); not sweeping step %d (gc aborts what it would have)",
                    catalog.where(self.store, dropped.step),
                    dropped.step,
                )
            if self._after is not None:
                return  # the running thread takes it before it ends
            t = self._after = threading.Thread(target=self._drain_after, name="ckptd-after-commit", daemon=True)
        t.start()

    def _drain_after(self) -> None:
        while True:
            with self._lock:
                batch, self._after_queue = self._after_queue, []
                if not batch:
                    self._after = None  # under the lock: a commit queued after this starts a new one
                    return
            for i, result in enumerate(batch):  # each step's sweep; retention once, for the newest
                keep = self.keep_last if i == len(batch) - 1 else None
                try:
                    retention.after_commit(self.store, result, keep, self.max_step_jump)
                except Exception:  # best effort, as after_commit itself is: never kill the thread
                    log.exception("%s: sweep and retention failed", catalog.where(self.store, result.step))

    def idle(self) -> None:
        """Block until the writer thread has nothing left to do (retention included)."""
        self._thread.submit(lambda: None).result()
        self._join_after()

    def _join_after(self) -> None:
        while True:
            with self._lock:
                t = self._after
            if t is None:
                return
            t.join()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
        self._join_after()
