"""Daemon mode of ``Checkpointer``: hand each snapshot to ``ckptd serve`` through shared memory.

Per save, on every rank (the training thread, inside ``Checkpointer.save``):

1. ``take`` asks ``DaemonStager.buffer`` for each shard's buffer. The first call of a save
   acquires the rank's staging lease (a folder the daemon grants, in ``/dev/shm`` by default)
   or creates one; buffers are files in it, mapped as tensors, so the snapshot copy *is* the
   copy into shared memory. The same files are reused by the next save once the daemon hands
   the lease back (no new pages to fault in). When the daemon's memory budget is full it
   answers 429 and the save waits, saying why in the log.
2. ``DaemonSink.submit`` writes the metadata objects into the lease too and posts the job
   description (``POST /v1/jobs``). From the 200 on, the daemon owns the files: it uploads
   them, writes the rank's done record and commits, even if this process dies the next instant.
3. The returned future is resolved by a poller thread (``GET /v1/jobs/{id}``) when the step is
   committed. While the daemon is unreachable (restarting), the poller reads the commit record
   from storage instead; it fails after ``commit_timeout``.

Trainer and daemon must see the same staging folder (same node; in containers, the same host
``/dev/shm`` mount). The client sends ``Authorization: Bearer`` with the token from
``CKPTD_TOKEN`` or the file named by ``CKPTD_TOKEN_FILE``. Only the standard library speaks
HTTP here, so training needs no HTTP package.

Concurrency: the training thread calls ``stager().buffer``, ``submit`` and ``shutdown``; the
poller thread resolves futures and heartbeats the lease. Neither writes into the lease's files
while the daemon owns it (between ``submit`` and the next save's acquire).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import torch

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, image_nbytes
from ckptd.commit import SaveResult
from ckptd.errors import CheckpointError
from storage_backends import StorageError, open_store
from trainer_hooks.snapshot import SaveJob, Stager, format_image, staged_image_chunks

log = logging.getLogger("ckptd.daemon_client")

_WAIT_LOG_EVERY_S = 30.0


def _token() -> str | None:
    token = os.environ.get("CKPTD_TOKEN")
    path = os.environ.get("CKPTD_TOKEN_FILE")
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise CheckpointError(f"cannot read CKPTD_TOKEN_FILE {path}: {e}") from None
    return token or None


class DaemonUnreachable(CheckpointError):
    pass


class _Http:
    """JSON requests over keep-alive HTTP/1.1, one connection per thread."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CheckpointError(f"daemon must be an http://host:port URL, got {url!r}")
        self.url = url.rstrip("/")
        self._cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parts.hostname, parts.port
        self._base = parts.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body or {}, headers). Raises DaemonUnreachable. Requests are idempotent
        (jobs carry a client-chosen id), so a stale keep-alive connection is retried once."""
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._cls(self._host, self._port, timeout=self._timeout)
                with self._lock:
                    self._all.append(conn)
            try:
                conn.request(method, self._base + path, body=data, headers=self._headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                if attempt:
                    raise DaemonUnreachable(f"cannot reach the ckptd daemon at {self.url}: {e}") from None
                continue
            try:
                payload = json.loads(raw) if raw else {}
            except ValueError:
                payload = {"detail": raw[:200].decode(errors="replace")}
            return resp.status, payload if isinstance(payload, dict) else {"items": payload}, dict(resp.headers)
        raise AssertionError("unreachable")

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local.conn = None


def _detail(body: dict) -> str:
    return str(body.get("detail", body))


class DaemonStager(Stager):
    """Snapshot buffers as files of a staging lease, mapped as tensors and reused across saves.

    ``pin`` is ignored: the buffers are shared-memory mappings, which CUDA copies into
    synchronously (the copy is correct, only not overlapped). Object images are files of the
    lease too: the daemon checks their size against the layout, rewrites the index, fills in the
    checksums in its private mapping and writes the file's pages as they are."""

    def __init__(self, sink: DaemonSink):
        super().__init__()
        self._sink = sink
        self.lease_id: str | None = None
        self._dir: Path | None = None
        self._granted = 0
        self._files: dict[tuple[str, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
        # object images among them: (key, coord) -> (layout, dtype, chunked view of the file)
        self._views: dict[tuple[str, tuple[int, ...]], tuple[ArrayLayout, torch.dtype, torch.Tensor]] = {}
        self._meta_names: list[str] = []
        self._meta_bytes = 0
        self._used: set[str] = set()
        self._in_save = False
        self._last_total = 0
        self._counter = 0
        # Held by the training thread while it stages; the poller takes it without waiting, to
        # unmap the files of a lease the daemon freed (their memory is only freed once unmapped).
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------- Stager API

    def buffer(self, key: str, coord: tuple[int, ...], shape: tuple[int, ...], dtype, pin: bool) -> torch.Tensor:
        with self._lock:
            return self._buffer(key, coord, shape, dtype)

    def _buffer(self, key: str, coord: tuple[int, ...], shape: tuple[int, ...], dtype) -> torch.Tensor:
        if not self._in_save:
            self._begin()
        hit = self._files.get((key, coord))
        if (
            hit is not None
            and (key, coord) not in self._views
            and tuple(hit[1].shape) == tuple(shape)
            and hit[1].dtype == dtype
        ):
            self._used.add(hit[0])
            return hit[1]
        if hit is not None:
            self._drop(key, coord)
        numel = math.prod(shape)
        name = self._new_file(numel * torch.empty((), dtype=dtype).element_size())
        if numel:
            buf = torch.from_file(str(self._dir / name), shared=True, size=numel, dtype=dtype).view(shape)
        else:
            buf = torch.empty(shape, dtype=dtype)
        self._files[(key, coord)] = (name, buf)
        self._used.add(name)
        return buf

    def image(
        self, key: str, coord: tuple[int, ...], layout: ArrayLayout, dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            return self._image(key, coord, layout, dtype)

    def _image(self, key: str, coord: tuple[int, ...], layout: ArrayLayout, dtype):
        chunks = staged_image_chunks(layout, coord, dtype)
        if chunks is None:
            return None
        if not self._in_save:
            self._begin()
        hit, seen = self._files.get((key, coord)), self._views.get((key, coord))
        if hit is not None and seen is not None and seen[0] == layout and seen[1] == dtype:
            self._used.add(hit[0])
            return seen[2], hit[1]
        if hit is not None:
            self._drop(key, coord)
        nbytes = image_nbytes(layout, chunks)
        name = self._new_file(nbytes)
        image = torch.from_file(str(self._dir / name), shared=True, size=nbytes, dtype=torch.uint8)
        view = format_image(image, layout, chunks, dtype)
        self._files[(key, coord)] = (name, image)
        self._views[(key, coord)] = (layout, dtype, view)
        self._used.add(name)
        return view, image

    def _new_file(self, nbytes: int) -> str:
        """A new file of ``nbytes`` in the lease (grown first if needed); its name."""
        self._ensure(self._allocated() + nbytes)
        name = f"{self._counter:08d}.bin"
        self._counter += 1
        fd = os.open(self._dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return name

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self._files.values())

    def release(self) -> None:
        with self._lock:
            self._files.clear()
            self._views.clear()
            self._in_save = False

    def lease_lost(self, lease_id: str) -> None:
        """The daemon freed ``lease_id`` (not handed back, or reclaimed while idle): unmap its
        files now rather than at the next save. Skipped while a save is staging."""
        if self._lock.acquire(blocking=False):
            try:
                if self.lease_id == lease_id and not self._in_save:
                    self._forget_lease()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------------- internals

    def _allocated(self) -> int:
        return sum(t.nbytes for _, t in self._files.values()) + self._meta_bytes

    def _drop(self, key: str, coord: tuple[int, ...]) -> None:
        name, _ = self._files.pop((key, coord))
        self._views.pop((key, coord), None)
        with contextlib.suppress(OSError):
            os.unlink(self._dir / name)

    def _forget_lease(self) -> None:
        """The lease is gone or stays with the daemon: never touch its files again."""
        self._files.clear()
        self._views.clear()
        self._meta_names, self._meta_bytes = [], 0
        self.lease_id, self._dir, self._granted = None, None, 0

    def _begin(self) -> None:
        self._in_save, self._used = True, set()
        if self.lease_id is None:
            return
        status, body, _ = self._sink.call("POST", f"/v1/leases/{self.lease_id}/acquire", patient=True)
        if status == 200:
            self._granted = body["bytes"]
            return
        if status == 409:  # an earlier job still reads it (that save failed or timed out here)
            self._sink.call("DELETE", f"/v1/leases/{self.lease_id}")
        elif status != 404:
            raise CheckpointError(f"ckptd daemon at {self._sink.url}: cannot reuse staging lease: {_detail(body)}")
        self._forget_lease()

    def _ensure(self, total: int) -> None:
        """Make the lease hold ``total`` bytes, waiting while the daemon's budget is full."""
        if self.lease_id is not None and total <= self._granted:
            return
        if self.lease_id is None:
            want = max(total, self._last_total)
            body = self._sink.call_waiting(
                "POST",
                "/v1/leases",
                {
                    "root": self._sink.root,
                    "rank": self._sink.rank,
                    "bytes": total,
                    "want": want,
                    "client": self._sink.client_id,
                },
            )
            self.lease_id, self._dir = body["lease"], Path(body["dir"])
            self._sink.lease_ttl = float(body.get("ttl_s", 60.0))
        else:
            need = total - self._granted
            want = max(need, self._last_total - self._granted, self._granted)  # geometric growth
            body = self._sink.call_waiting("POST", f"/v1/leases/{self.lease_id}/grow", {"bytes": need, "want": want})
        self._granted = body["bytes"]

    def finish(self, job: SaveJob) -> tuple[str, list[dict], list[dict]]:
        """(lease, the job's shard files, its metadata files), written into the lease; files of
        tensors this save no longer has are deleted."""
        with self._lock:
            return self._finish(job)

    def _finish(self, job: SaveJob) -> tuple[str, list[dict], list[dict]]:
        if not self._in_save:
            self._begin()
        shards = []
        for sw in job.shards:
            hit = self._files.get((sw.key, sw.coord))
            if hit is None or hit[1] is not (sw.buffer if sw.image is None else sw.image):
                raise CheckpointError(f"array {sw.key!r}: snapshot buffer is not in the staging lease")
            lay = sw.layout
            layout = {
                "shape": list(lay.shape),
                "dtype": lay.dtype,
                "shard_shape": list(lay.shard_shape),
                "chunk_shape": list(lay.chunk_shape),
            }
            shard = {"key": sw.key, "layout": layout, "coord": list(sw.coord), "file": hit[0]}
            if sw.image is not None:
                shard["image"] = True
            shards.append(shard)
        for k in [k for k, (name, _) in self._files.items() if name not in self._used]:
            self._drop(*k)
        meta_bytes = sum(len(d) for _, d in job.metadata)
        self._meta_bytes = 0
        self._ensure(self._allocated() + meta_bytes)  # creates the lease if the job has no buffers
        metadata = []
        for i, (key, data) in enumerate(job.metadata):
            name = f"meta_{i:06d}.bin"
            with open(self._dir / name, "wb") as f:
                f.write(data)
            metadata.append({"key": key, "file": name})
        for name in self._meta_names[len(job.metadata) :]:
            with contextlib.suppress(OSError):
                os.unlink(self._dir / name)
        self._meta_names = [m["file"] for m in metadata]
        self._meta_bytes = meta_bytes
        self._last_total = self._allocated()
        self._in_save = False
        return self.lease_id, shards, metadata


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

    UNREACHABLE_WAIT_S = 60.0  # how long a save waits for an unreachable daemon (a restart)
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
        self.lease_ttl = 60.0
        self._http = _Http(self.url, _token())
        try:
            status, body, _ = self.call("POST", "/v1/roots/check", {"root": root_uri})
            if status != 200:
                raise CheckpointError(f"ckptd daemon at {self.url} refused job root {root_uri}: {_detail(body)}")
            features = self._features()
        except CheckpointError:
            self._http.close()
            raise
        self._stager = DaemonStager(self)
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
        status, body, _ = self.call("GET", "/v1/status")
        return set(body.get("features") or ()) if status == 200 and isinstance(body, dict) else set()

    # -------------------------------------------------------------------------- sink API

    def stager(self) -> Stager:
        return self._stager

    def submit(self, job: SaveJob) -> Future:
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
            status, reply, _ = self.call("POST", "/v1/jobs", body, patient=True)
            if status != 200:
                raise CheckpointError(f"{where}: the ckptd daemon refused rank {job.rank}'s snapshot: {_detail(reply)}")
        except CheckpointError as e:
            fut.set_exception(e)
            return fut
        now = time.monotonic()
        with self._cv:
            self._pending.append(_Pending(fut, job_id, lease, job.step, job.attempt, now + self.commit_timeout, now))
            self._cv.notify()
        return fut

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
                self.call("DELETE", f"/v1/leases/{self._stager.lease_id}")
        self._stager.release()
        self._http.close()
        if self._store is not None:
            self._store.close()

    # --------------------------------------------------------------------------- calls

    def call(self, method: str, path: str, body: dict | None = None, patient: bool = False) -> tuple[int, dict, dict]:
        """One request. ``patient``: while the daemon is unreachable (restarting), retry for up to
        ``UNREACHABLE_WAIT_S``, logging why the save waits."""
        deadline = time.monotonic() + self.UNREACHABLE_WAIT_S
        logged = False
        while True:
            try:
                status, reply, headers = self._http.request(method, path, body)
                break
            except DaemonUnreachable as e:
                if not patient or time.monotonic() > deadline:
                    raise
                if not logged:
                    log.warning("rank %d: save waits for the ckptd daemon: %s", self.rank, e)
                    logged = True
                time.sleep(0.5)
        if status == 401:
            raise CheckpointError(
                f"ckptd daemon at {self.url} refused the request (401): set CKPTD_TOKEN or CKPTD_TOKEN_FILE"
            )
        return status, reply, headers

    def call_waiting(self, method: str, path: str, body: dict) -> dict:
        """A staging request; while the daemon answers 429 (budget full) wait and ask again."""
        waited_since = None
        last_log = 0.0
        while True:
            status, reply, headers = self.call(method, path, body, patient=True)
            if status == 200:
                if waited_since is not None:
                    log.info("staging memory granted after waiting %.1f s", time.monotonic() - waited_since)
                return reply
            if status not in (429, 503):
                raise CheckpointError(
                    f"ckptd daemon at {self.url}: {method} {path} failed ({status}): {_detail(reply)}"
                )
            now = time.monotonic()
            if waited_since is None:
                waited_since = now
            if now - last_log >= _WAIT_LOG_EVERY_S:
                last_log = now
                log.warning(
                    "rank %d: save waits for staging memory: the ckptd daemon's budget is full (%s of %s bytes "
                    "staged, %d needed)",
                    self.rank,
                    reply.get("staged", "?"),
                    reply.get("budget", "?"),
                    body.get("bytes", 0),
                )
            try:
                retry = float(headers.get("Retry-After", "1"))
            except ValueError:
                retry = 1.0
            time.sleep(min(max(retry, 0.05), 0.25))

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
                    if self.call("POST", f"/v1/leases/{lease}/heartbeat")[0] == 404:
                        self._stager.lease_lost(lease)  # reclaimed for another client's snapshot
                next_beat = now + min(self.lease_ttl / 4, self.HEARTBEAT_S)
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
            status, body, _ = self.call("GET", f"/v1/jobs/{quote(p.job)}" + (f"?wait={wait:g}" if wait else ""))
        except CheckpointError:
            status, body = None, {}
        now = time.monotonic()
        if status == 200:
            p.missing_since = None
            state = body.get("state")
            if body.get("lease_kept") is False:
                self._stager.lease_lost(p.lease)
            if state == "committed":
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
                p.future.set_exception(CheckpointError(f"{where}: rank {self.rank}: {body.get('error') or state}"))
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
