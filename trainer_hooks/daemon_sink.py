"""Daemon mode of ``Checkpointer``: hand each snapshot to ``ckptd serve`` through shared memory.

Per save, on every rank (the training thread, inside ``Checkpointer.save``):

1. ``take`` asks the ``DaemonStager`` (``daemon_stager``) for each shard's buffer: files of the
   rank's staging lease, so the snapshot copy is the copy into shared memory.
2. ``DaemonSink.submit`` has the stager write the metadata objects into the lease too and posts
   the job description (``POST /v1/jobs``). From the 200 on, the daemon owns the files: it
   uploads them, writes the rank's done record and commits, even if this process dies the next
   instant.
3. The returned future is resolved by a poller thread (``GET /v1/jobs/{id}``) when the step is
   committed. While the daemon is unreachable (restarting), the poller reads the commit record
   from storage instead; it fails after ``commit_timeout``.

HTTP goes through ``ckptd.daemon_conn.DaemonConnection``. Concurrency: the training thread calls
``stager().buffer``, ``submit`` and ``shutdown``; the poller thread resolves futures and
heartbeats the lease.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from urllib.parse import quote

from ckptd import catalog, claims
from ckptd import manifest as mf
from ckptd.auth import daemon_token
from ckptd.daemon_conn import DaemonConnection, detail
from ckptd.errors import CheckpointError
from ckptd.persist import SaveResult
from ckptd.savejob import SaveJob
from storage_backends import StorageError, open_store
from trainer_hooks.daemon_stager import DaemonStager
from trainer_hooks.snapshot import Stager

__all__ = ["DaemonSink"]


@dataclass
class _Pending:
    future: Future
    job: str
    lease: str
    step: int
    attempt: str
    deadline: float
    submitted: float
    missing_since: float | None = None
    next_storage_check: float = 0.0


class DaemonSink:
    """Hands snapshots to a ``ckptd serve`` daemon; see the module docstring."""

    HEARTBEAT_S = 2.0  # also how soon this client unmaps a lease the daemon reclaimed while idle
    LONG_POLL_S = 1.0  # how long the daemon may hold a job status request (< HEARTBEAT_S)
    FORGOTTEN_S = 10.0  # a job the daemon does not know for this long (and not committed) failed

    def __init__(
        self,
        daemon_url: str,
        root_uri: str,
        rank: int,
        world_size: int,
        keep_last: int | None,
        commit_timeout: float,
    ):
        self.url = daemon_url.rstrip("/")
        self.root = root_uri
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.commit_timeout = keep_last, commit_timeout
        self.client_id = uuid.uuid4().hex[:16]
        self._client = DaemonConnection(self.url, daemon_token(), who=f"rank {rank}")
        try:
            status, body, _ = self._client.call("POST", "/v1/roots/check", {"root": root_uri})
            if status != 200:
                raise CheckpointError(f"ckptd daemon at {self.url} refused job root {root_uri}: {detail(body)}")
            features = self._features()
        except CheckpointError:
            self._client.close()
            raise
        self._stager = DaemonStager(self._client, root_uri, rank, self.client_id)
        # An older daemon takes plain shard files only, and answers job polls at once.
        self._stager.images = "image_handoff" in features
        self.long_poll = "job_long_poll" in features
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._stop = False
        self._store = None
        self._thread = threading.Thread(target=self._poll_loop, name="ckptd-daemon-poll", daemon=True)
        self._thread.start()

    def _features(self) -> set[str]:
        """What the daemon supports beyond the first API (``features`` of ``/v1/status``)."""
        status, body, _ = self._client.call("GET", "/v1/status")
        return set(body.get("features") or ()) if status == 200 and isinstance(body, dict) else set()

    # -------------------------------------------------------------------------- sink API

    def stager(self) -> Stager:
        return self._stager

    def reserve_memory(self, step: int, attempt: str, nbytes: int, objects: int = 0) -> bool:
        """Ask the daemon to hold room (``nbytes``, ``objects``) for this rank's part of
        memory-only ``step`` (``trainer_hooks.memsteps``); False when it has none (or predates
        memory-only steps)."""
        body = {"root": self.root, "step": step, "attempt": attempt, "rank": self.rank, "bytes": nbytes}
        body["objects"] = objects
        status, reply, _ = self._client.call("POST", "/v1/tiers/reserve", body)
        return status == 200 and isinstance(reply, dict) and reply.get("ok") is True

    def submit(self, job: SaveJob) -> Future:
        return self._submit(job, False)

    def submit_memory(self, job: SaveJob) -> Future:
        """``submit`` of a memory-only step: the daemon holds this rank's part in its memory and
        never writes it to the job root (``ckptd.server.tiers``); the future resolves once it
        holds the part."""
        return self._submit(job, True)

    def _submit(self, job: SaveJob, memory_only: bool) -> Future:
        fut: Future = Future()
        where = f"{self.root.rstrip('/')}/{mf.step_dir(job.step)}"
        try:
            if job.ready is not None:
                job.ready.synchronize()  # device-to-host copies have landed in the staging files
            lease, shards, metadata = self._stager.finish(job)
            job_id = uuid.uuid4().hex
            body = {
                "job": job_id,
                "lease": lease,
                "root": self.root,
                "step": job.step,
                "attempt": job.attempt,
                "rank": job.rank,
                "world_size": job.world_size,
                "shards": shards,
                "metadata": metadata,
                "done": job.done,
                "writer": getattr(self, "writer", None),  # the job id that claims the step
                "commit_timeout": self.commit_timeout,
            }
            if memory_only:
                body["memory_only"] = True
            status, reply, _ = self._client.call("POST", "/v1/jobs", body, patient=True)
            if status != 200:
                raise CheckpointError(f"{where}: the ckptd daemon refused rank {job.rank}'s snapshot: {detail(reply)}")
        except CheckpointError as e:
            fut.set_exception(e)
            return fut
        now = time.monotonic()
        with self._cv:
            self._pending.append(_Pending(fut, job_id, lease, job.step, job.attempt, now + self.commit_timeout, now))
            self._cv.notify()
        return fut

    def idle(self) -> None:
        """Nothing runs here after a commit: retention is the daemon's."""

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            pending, self._pending = self._pending, []
            self._cv.notify()
        self._thread.join(timeout=10)
        for p in pending:
            if not p.future.done():
                p.future.set_exception(CheckpointError(f"step {p.step}: closed before the daemon reported its commit"))
        if self._stager.lease_id is not None:
            with contextlib.suppress(CheckpointError):
                self._client.call("DELETE", f"/v1/leases/{self._stager.lease_id}")
        self._stager.release()
        self._client.close()
        if self._store is not None:
            self._store.close()

    # -------------------------------------------------------------------------- poller

    def _poll_loop(self) -> None:
        next_beat = time.monotonic()
        delay = 0.01
        while True:
            with self._cv:
                if self._stop:
                    return
                if not self._pending:
                    delay = 0.01
                    self._cv.wait(timeout=max(0.0, next_beat - time.monotonic()) if self._stager.lease_id else None)
                if self._stop:
                    return
                pending = list(self._pending)
            now = time.monotonic()
            lease = self._stager.lease_id
            if lease is not None and now >= next_beat:
                with contextlib.suppress(CheckpointError):
                    if self._client.call("POST", f"/v1/leases/{lease}/heartbeat")[0] == 404:
                        self._stager.lease_lost(lease)  # reclaimed for another client's snapshot
                next_beat = now + min(self._stager.lease_ttl / 4, self.HEARTBEAT_S)
            # The oldest job (the next to commit) is long-polled: the daemon answers the moment
            # it is final, or after LONG_POLL_S (within the heartbeat period); the others are
            # checked in passing.
            held = False
            for i, p in enumerate(pending):
                t0 = time.monotonic()
                if self._check(p, wait=self.LONG_POLL_S if i == 0 and self.long_poll else 0.0):
                    with self._cv:
                        self._pending.remove(p)
                    held = True
                elif i == 0 and self.long_poll:
                    held = time.monotonic() - t0 >= self.LONG_POLL_S / 2
            if pending and not held:  # a daemon without long polls, or unreachable: back off
                time.sleep(delay)
                delay = min(delay * 1.5, 0.2)

    def _check(self, p: _Pending, wait: float = 0.0) -> bool:
        """Resolve ``p`` if its outcome is known (waiting up to ``wait`` s for it in the daemon).
        True when done."""
        where = f"{self.root.rstrip('/')}/{mf.step_dir(p.step)}"
        try:
            status, body, _ = self._client.call("GET", f"/v1/jobs/{quote(p.job)}" + (f"?wait={wait:g}" if wait else ""))
        except CheckpointError:
            status, body = None, {}
        now = time.monotonic()
        if status == 200:
            p.missing_since = None
            state = body.get("state")
            if body.get("lease_kept") is False:
                self._stager.lease_lost(p.lease)
            if state in ("committed", "held"):  # held: a memory-only step's part is in the daemon's memory
                p.future.set_result(
                    SaveResult(
                        p.step,
                        int(body.get("bytes_written", 0)),
                        int(body.get("objects_written", 0)),
                        bool(body.get("committed_here", False)),
                        float(body.get("handoff_to_commit_s", now - p.submitted)),
                    )
                )
                return True
            if state in ("failed", "discarded"):
                kind = claims.REFUSALS.get(str(body.get("error_kind")), CheckpointError)  # a closed set of kinds
                p.future.set_exception(kind(f"{where}: rank {self.rank}: {body.get('error') or state}"))
                return True
        else:
            # The daemon is down or restarted without this job: the storage has the truth.
            p.missing_since = p.missing_since or now
            if now >= p.next_storage_check:
                p.next_storage_check = now + 1.0
                try:
                    if self._store is None:
                        self._store = open_store(self.root)
                    commit = catalog.read_commit(self._store, p.step)
                except (StorageError, CheckpointError):
                    commit = None
                if commit is not None and commit.get("attempt") == p.attempt:
                    p.future.set_result(SaveResult(p.step, 0, 0, False, now - p.submitted))
                    return True
                if commit is not None:
                    p.future.set_exception(CheckpointError(f"{where}: committed by another attempt"))
                    return True
            if status == 404 and now - p.missing_since > self.FORGOTTEN_S:
                p.future.set_exception(CheckpointError(f"{where}: the ckptd daemon at {self.url} lost job {p.job}"))
                return True
        if now > p.deadline:
            p.future.set_exception(
                CheckpointError(f"{where}: not committed {self.commit_timeout:.0f} s after hand-off to {self.url}")
            )
            return True
        return False
