"""The in-process writer: one background thread that runs the commit protocol
(:mod:`ckptd.commit`) for each snapshot of this rank, in submission order.

The training thread hands a ``SaveJob`` to :meth:`BackgroundWriter.submit` and gets a future
that resolves at the commit (or fails with the save's error); everything that talks to storage
runs on the writer's thread and its I/O pool.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ckptd import commit
from ckptd.savejob import SaveJob
from storage_backends import Store
from trainer_hooks.flatten import as_numpy
from trainer_hooks.snapshot import Stager

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """One thread that persists jobs in submission order, fanning puts out on an I/O pool."""

    def __init__(
        self,
        store: Store,
        io_pool: ThreadPoolExecutor,
        keep_last: int | None,
        commit_timeout: float,
        incremental: bool = False,
    ):
        self.store = store
        self.io = io_pool
        self.keep_last = keep_last
        self.commit_timeout = commit_timeout
        self.dedupe = commit.Dedupe() if incremental else None
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
        try:
            result = commit.persist(
                self.store, job, self.io, commit_timeout=self.commit_timeout, dedupe=self.dedupe, to_numpy=as_numpy
            )
        except BaseException as e:
            if self.dedupe is not None:
                self.dedupe.failed()
            fut.set_exception(e)
            return
        if self.dedupe is not None:
            self.dedupe.committed(job.step)
        fut.set_result(result)
        commit.after_commit(self.store, result, self.keep_last)

    def idle(self) -> None:
        """Block until the writer thread has nothing left to do (retention included)."""
        self._thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
