"""The in-process writer: one background thread that runs the commit protocol
(:mod:`ckptd.persist`) for each snapshot of this rank, in submission order.

The training thread hands a ``SaveJob`` to :meth:`BackgroundWriter.submit` and gets a future
that resolves at the commit (or fails with the save's error); everything that talks to storage
-- the claim of the step, the check that it is not committed, the data, the commit, cleanup of
this job's failed saves and retention -- runs on the writer's threads, never the caller's.

Deadline: each save runs on a thread of its own that the writer waits for at most
``save_timeout`` seconds. Past that the save's future fails ("storage did not answer") and the
save is aborted: if its thread ever gets an answer from storage, it writes nothing more, and
neither a done record nor a commit, so the buffers the caller reuses for the next snapshot can
never be committed half-overwritten. A thread stuck in a storage call stays stuck until that
call's own timeout (S3: ``CKPTD_S3_*_TIMEOUT``); the writer does not wait for it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from ckptd import catalog, claims, persist, retention
from ckptd.errors import AlreadyCommitted, CheckpointError, StepClaimed
from ckptd.savejob import SaveJob
from storage_backends import Store
from trainer_hooks.flatten import as_numpy
from trainer_hooks.snapshot import Stager

__all__ = ["BackgroundWriter"]

log = logging.getLogger("ckptd.writer")


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
        self._stuck = 0  # saves abandoned at their deadline whose thread has not returned yet
        self._lock = threading.Lock()
        self._failed: list[tuple[int, str]] = []  # (step, attempt) of failed saves: reclaimed at the next save
        self._abandoned: list[tuple[int, threading.Thread]] = []  # saves past their deadline
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckptd-writer")

    def stager(self) -> Stager:
        return Stager()

    def submit(self, job: SaveJob) -> Future:
        """The future resolves at the commit; retention runs after it, on the same thread, so it
        delays neither the caller nor the next save's snapshot (only that save's writes)."""
        fut: Future = Future()
        self._thread.submit(self._persist, job, fut)
        return fut

    def _persist(self, job: SaveJob, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        # The caller submits only after the collective of save(), which every rank reaches
        # after its previous save ended: no rank of this job still writes the failed steps.
        failed, self._failed = [(s, a) for s, a in self._failed if s != job.step], []
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
            finally:
                with self._lock:
                    if abort.is_set():
                        self._stuck -= 1

        t = threading.Thread(target=run, name=f"ckptd-save-{job.step}", daemon=True)
        t.start()
        t.join(self.save_timeout)
        with self._lock:
            if t.is_alive():
                abort.set()
                self._stuck += 1
        if abort.is_set():
            self._abandoned.append((job.step, t))
            box["error"] = CheckpointError(
                f"{catalog.where(self.store, job.step)}: save did not finish within {self.save_timeout:g} s "
                "(save_timeout): storage did not answer; the step is abandoned and will not commit"
            )
        err = box.get("error")
        if err is not None:
            if self.dedupe is not None:
                self.dedupe.failed()
            if not isinstance(err, AlreadyCommitted | StepClaimed):
                self._failed.append((job.step, job.attempt))  # not ours to reclaim otherwise
            fut.set_exception(err)
            return
        result = box["result"]
        if self.dedupe is not None:
            self.dedupe.committed(job.step)
        fut.set_result(result)
        retention.after_commit(self.store, result, self.keep_last)

    @property
    def stuck(self) -> int:
        """Saves abandoned at their deadline whose thread is still inside a storage call."""
        with self._lock:
            return self._stuck

    def idle(self) -> None:
        """Block until the writer thread has nothing left to do (retention included)."""
        self._thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
