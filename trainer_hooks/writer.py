"""Persisting one rank's part of a checkpoint and committing it.

Order of writes for one rank (the commit protocol, the same in-process and in the daemon):

1. shards and metadata (array ``zarr.json``; on rank 0 also groups and ``manifest.json``),
   in parallel on an I/O pool; each put is durable when it returns;
2. this rank's done record ``_done/<attempt>/rank_N.json`` (bytes, objects, RNG state);
3. ``try_commit``: the rank that sees every done record writes ``commit.json`` once;
4. the other ranks poll for ``commit.json`` so that their future, too, resolves only when the
   checkpoint is committed (and fails if it never is, naming how many ranks finished).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.codec import encode_shard
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


def persist(
    store: Store,
    job: SaveJob,
    pool: ThreadPoolExecutor,
    keep_last: int | None = None,
    commit_timeout: float = 1800.0,
    *,
    wait: bool = True,
) -> SaveResult:
    """Write ``job`` and wait for its checkpoint to commit. Runs on a background thread.

    ``wait=False`` returns once this rank's data and done record are durable (and the commit
    tried), without polling for the other ranks' commit: the daemon watches commits of many jobs
    from one thread instead of parking an upload worker per job."""
    t0 = time.perf_counter()
    if job.ready is not None:
        job.ready.synchronize()  # the D2H copies into pinned buffers have landed
    folder = mf.step_dir(job.step)
    where = f"{store.uri.rstrip('/')}/{folder}"

    def put_meta(key: str, data: bytes) -> int:
        store.put(f"{folder}/{key}", data)
        return len(data)

    def put_shard(sw) -> int:
        bufs = encode_shard(sw.layout, sw.coord, as_numpy(sw.buffer))
        store.put(f"{folder}/{sw.object_key}", bufs)
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
    record = {"rank": job.rank, "bytes": nbytes, "objects": objects, "time": time.time(), **job.done}
    try:
        store.put(mf.done_key(job.step, job.attempt, job.rank), mf.dumps(record))
        committed = catalog.try_commit(store, job.step, job.attempt, job.world_size)
    except StorageError as e:
        raise CheckpointError(f"{where}: rank {job.rank} failed to record completion: {e}") from e
    if committed:
        log.info("committed %s (%d ranks)", where, job.world_size)
        if keep_last:
            try:
                deleted = catalog.retain(store, keep_last)
                if deleted:
                    log.info("retention removed steps %s", deleted)
            except (CheckpointError, StorageError) as e:  # retention must not fail a save
                log.warning("retention failed: %s", e)
    elif wait:
        _wait_commit(store, job, where, commit_timeout)
    return SaveResult(job.step, nbytes, objects, committed, time.perf_counter() - t0)


def _wait_commit(store: Store, job: SaveJob, where: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.005
    commit = f"{mf.step_dir(job.step)}/{mf.COMMIT}"
    while True:
        if store.exists(commit):
            return
        if time.monotonic() > deadline:
            n = sum(1 for _ in store.list(mf.done_prefix(job.step, job.attempt)))
            raise CheckpointError(
                f"{where}: not committed after {timeout:.0f} s: {n} of {job.world_size} ranks finished"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


class BackgroundWriter:
    """One thread that persists jobs in submission order, fanning puts out on an I/O pool."""

    def __init__(self, store: Store, io_pool: ThreadPoolExecutor, keep_last: int | None, commit_timeout: float):
        self.store = store
        self.io = io_pool
        self.keep_last = keep_last
        self.commit_timeout = commit_timeout
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckptd-writer")

    def stager(self) -> Stager:
        return Stager()

    def submit(self, job: SaveJob) -> Future:
        return self._thread.submit(persist, self.store, job, self.io, self.keep_last, self.commit_timeout)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
