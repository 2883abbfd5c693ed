"""Persisting one rank's part of a checkpoint and committing it.

Order of writes for one rank (the commit protocol, the same in-process and in the daemon):

1. shards and metadata (array ``zarr.json``; on rank 0 also groups and ``manifest.json``),
   in parallel on an I/O pool; each put is durable when it returns;
2. this rank's done record (bytes, objects, RNG state) in the done tree (``ckptd.donetree``);
3. ``finish_rank`` climbs the tree: the rank that completes it writes ``commit.json`` once;
4. the other ranks poll for ``commit.json`` so that their future, too, resolves only when the
   checkpoint is committed (and fails if it never is, naming how many ranks finished).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd.codec import encode_shard, seal_image
from ckptd.errors import CheckpointError
from storage_backends import StorageError, Store
from storage_backends.base import data_size
from trainer_hooks.flatten import as_numpy
from trainer_hooks.snapshot import SaveJob, Stager

log = logging.getLogger("ckptd.writer")


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


def persist(
    store: Store,
    job: SaveJob,
    pool: ThreadPoolExecutor,
    keep_last: int | None = None,
    commit_timeout: float = 1800.0,
    *,
    wait: bool = True,
    dedupe: Dedupe | None = None,
) -> SaveResult:
    """Write ``job`` and wait for its checkpoint to commit. Runs on a background thread.

    ``dedupe`` (incremental saves): shards whose content hash equals the one this writer saved
    at the previous committed step are hard-linked (filesystem) or server-side copied (S3) from
    that checkpoint instead of uploaded; every checkpoint stays complete on its own.

    ``wait=False`` returns once this rank's data and done record are durable (and the commit
    tried), without polling for the other ranks' commit: the daemon watches commits of many jobs
    from one thread instead of parking an upload worker per job."""
    t0 = time.perf_counter()
    if job.ready is not None:
        job.ready.synchronize()  # the D2H copies into pinned buffers have landed
    folder = mf.step_dir(job.step)
    where = f"{store.uri.rstrip('/')}/{folder}"

    # Data goes in with put_deferred and one sync before the done record: on a filesystem that
    # is one syncfs instead of an fsync per file and per folder (hundreds of them per save).
    def put_meta(key: str, data: bytes) -> int:
        store.put_deferred(f"{folder}/{key}", data)
        return len(data)

    def put_shard(sw) -> int:
        key = f"{folder}/{sw.object_key}"
        if sw.image is not None:  # staged as the object itself: checksum it in place, send it whole
            data = sw.image.numpy()
            seal_image(sw.layout, data, sw.chunks)
        else:
            data = as_numpy(sw.buffer)
        if dedupe is not None:
            digest = dedupe.digest(sw, data)
            if dedupe.try_reuse(store, sw.object_key, digest, key):
                return 0  # unchanged since the last commit: linked/copied, no bytes written
        bufs = [memoryview(data)] if sw.image is not None else encode_shard(sw.layout, sw.coord, data)
        store.put_deferred(key, bufs)
        return data_size(bufs)

    futures = [pool.submit(put_meta, k, d) for k, d in job.metadata]
    futures += [pool.submit(put_shard, sw) for sw in job.shards]
    nbytes, err = 0, None
    for f in futures:
        try:
            nbytes += f.result()
        except (StorageError, OSError, ValueError) as e:
            err = err or e
    if err is not None:
        raise CheckpointError(f"{where}: rank {job.rank} failed to write its data: {err}") from err
    objects = len(futures)
    t_written = time.perf_counter()
    try:
        store.sync()
    except (StorageError, OSError) as e:
        raise CheckpointError(f"{where}: rank {job.rank} failed to make its data durable: {e}") from e
    t_synced = time.perf_counter()
    record = {"rank": job.rank, "bytes": nbytes, "objects": objects, "time": time.time(), **job.done}
    try:
        committed = catalog.finish_rank(store, job.step, job.attempt, job.rank, job.world_size, record)
    except StorageError as e:
        raise CheckpointError(f"{where}: rank {job.rank} failed to record completion: {e}") from e
    if committed:
        log.info("committed %s (%d ranks)", where, job.world_size)
        if keep_last:
            apply_retention(store, keep_last)
    elif wait:
        _wait_commit(store, job, where, commit_timeout)
    t1 = time.perf_counter()
    phases = {"write": t_written - t0, "sync": t_synced - t_written, "commit": t1 - t_synced}
    return SaveResult(job.step, nbytes, objects, committed, t1 - t0, phases)


def apply_retention(store: Store, keep_last: int) -> None:
    """Retention after a commit; its failure never fails the save that triggered it."""
    try:
        deleted = catalog.retain(store, keep_last)
        if deleted:
            log.info("retention removed steps %s", deleted)
    except (CheckpointError, StorageError) as e:
        log.warning("retention failed: %s", e)


def _wait_commit(store: Store, job: SaveJob, where: str, timeout: float) -> None:
    """Poll for the commit record, at the pace of ``catalog.commit_poll_delays`` (all ranks
    together near 2000 existence checks per second; an S3 prefix serves ~5500)."""
    deadline = time.monotonic() + timeout
    delays = catalog.commit_poll_delays(job.world_size, job.rank)
    commit = f"{mf.step_dir(job.step)}/{mf.COMMIT}"
    while True:
        if store.exists(commit):
            return
        if time.monotonic() > deadline:
            n = donetree.count_done(store, job.step, job.attempt)
            raise CheckpointError(
                f"{where}: not committed after {timeout:.0f} s: {n} of {job.world_size} ranks finished"
            )
        time.sleep(next(delays))


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

    def digest(self, sw, data) -> str:
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
        self.dedupe = Dedupe() if incremental else None
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
            result = persist(self.store, job, self.io, None, self.commit_timeout, dedupe=self.dedupe)
        except BaseException as e:
            if self.dedupe is not None:
                self.dedupe.failed()
            fut.set_exception(e)
            return
        if self.dedupe is not None:
            self.dedupe.committed(job.step)
        fut.set_result(result)
        if result.committed_here and self.keep_last:
            apply_retention(self.store, self.keep_last)

    def idle(self) -> None:
        """Block until the writer thread has nothing left to do (retention included)."""
        self._thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
