"""The commit protocol: how one writer's part of a checkpoint becomes a committed checkpoint.

Every writer calls this module -- the in-process background writer
(``trainer_hooks.writer.BackgroundWriter``), the ``ckptd serve`` daemon (``ckptd.server.jobs``)
and the streaming :class:`ckptd.stream.CheckpointWriter` (``ckptd import``, ``reshard
--rechunk``) -- so a save has one order of writes wherever it runs. For one step, on every
rank (a "writer part" below is one rank's share of the step)::

    begin(store, step)                   # refuse a committed step; clear a stale partial
    persist(store, part, pool)           # the rest, top to bottom:
        write data                       #   shards + metadata with put_deferred, in parallel
        store.sync()                     #   one durability barrier for all of it
        finish_rank(...)                 #   done record into the done tree (this rank is
                                         #   durable), then climb it: the rank that completes
                                         #   the tree writes commit.json once (commit_step)
        wait_commit(...)                 #   the others poll for it (bounded by commit_timeout)
    after_commit(store, result, keep_last)   # retention, by the committing writer, after its
                                             # result is reported (never delays the save)

``begin`` runs once per step (on rank 0 before any rank writes); ``persist`` once per rank.
A ``part`` is duck-typed (``ckptd.savejob.SaveJob`` is one): ``step``, ``attempt``,
``rank``, ``world_size``, ``metadata`` (``[(key in the folder, bytes)]``), ``shards`` (objects
with ``layout``, ``coord``, ``object_key``, ``buffer``, ``image``, ``chunks``), ``done`` (extra
fields of the done record) and ``ready`` (an event with ``synchronize()`` or None). Turning a
shard's ``buffer`` into a numpy array is the caller's business (``to_numpy``): this module
knows numpy and the store, not torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
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
from storage_backends import StorageError, Store
from storage_backends.base import data_size

log = logging.getLogger("ckptd.commit")


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


# ------------------------------------------------------------------------------------ begin


def begin(store: Store, step: int) -> None:
    """Before any rank writes ``step``: refuse it if committed (a committed checkpoint is
    immutable), else remove a stale partial folder of an earlier attempt at the same step.

    Done records are per attempt, so leftovers of a crashed attempt could never complete a new
    one's commit; removing them keeps ``ls`` and the bytes honest. Raises CheckpointError."""
    where = catalog.where(store, step)
    try:
        if store.exists(f"{mf.step_dir(step)}/{mf.COMMIT}"):
            raise CheckpointError(f"{where}: step {step} is already committed; refusing to overwrite")
        # purge, not a listing: a killed save may have left only temp files, which no listing
        # shows and which would otherwise stay inside the new commit
        files, _ = store.purge(f"{mf.step_dir(step)}/")
        if files:
            log.warning("removed stale partial checkpoint %s", where)
    except StorageError as e:
        raise CheckpointError(f"{where}: {e}") from e


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
    commit_timeout: float = 1800.0,
    wait: bool = True,
    dedupe: Dedupe | None = None,
    to_numpy: Callable[[Any], np.ndarray] = np.asarray,
) -> SaveResult:
    """Write one rank's ``part`` of a checkpoint and commit it if it is the last. Runs on a
    background thread (the in-process writer's or a daemon upload worker), never on the
    training thread.

    ``wait=False`` returns once this rank's data and done record are durable (and the commit
    tried), without polling for the other ranks' commit: the daemon watches commits of many jobs
    from one thread instead of parking an upload worker per job.

    ``dedupe`` (incremental saves): shards whose content hash equals the one this writer saved
    at the previous committed step are hard-linked (filesystem) or server-side copied (S3) from
    that checkpoint instead of uploaded; every checkpoint stays complete on its own."""
    t0 = time.perf_counter()
    if part.ready is not None:
        part.ready.synchronize()  # the D2H copies into pinned buffers have landed
    where = catalog.where(store, part.step)
    nbytes, objects = _write_data(store, part, pool, dedupe, to_numpy, where)
    t_written = time.perf_counter()
    try:
        store.sync()
    except (StorageError, OSError) as e:
        raise CheckpointError(f"{where}: rank {part.rank} failed to make its data durable: {e}") from e
    t_synced = time.perf_counter()
    record = {"rank": part.rank, "bytes": nbytes, "objects": objects, "time": time.time(), **part.done}
    try:
        committed = finish_rank(store, part.step, part.attempt, part.rank, part.world_size, record)
    except StorageError as e:
        raise CheckpointError(f"{where}: rank {part.rank} failed to record completion: {e}") from e
    if committed:
        log.info("committed %s (%d ranks)", where, part.world_size)
    elif wait:
        wait_commit(store, part.step, part.attempt, part.world_size, commit_timeout, part.rank)
    t1 = time.perf_counter()
    phases = {"write": t_written - t0, "sync": t_synced - t_written, "commit": t1 - t_synced}
    return SaveResult(part.step, nbytes, objects, committed, t1 - t0, phases)


def _write_data(store: Store, part: Any, pool: ThreadPoolExecutor, dedupe, to_numpy, where: str) -> tuple[int, int]:
    """Put every shard and metadata object of ``part`` (not yet durable: one ``sync`` follows;
    on a filesystem that is one syncfs instead of an fsync per file and folder). Returns
    (bytes, objects) written."""
    folder = mf.step_dir(part.step)

    def put_meta(key: str, data: bytes) -> int:
        store.put_deferred(f"{folder}/{key}", data)
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
            if dedupe.try_reuse(store, sw.object_key, digest, key):
                return 0  # unchanged since the last commit: linked/copied, no bytes written
        bufs = [memoryview(data)] if sw.image is not None else encode_shard(sw.layout, sw.coord, data)
        store.put_deferred(key, bufs)
        return data_size(bufs)

    futures = [pool.submit(put_meta, k, d) for k, d in part.metadata]
    futures += [pool.submit(put_shard, sw) for sw in part.shards]
    nbytes, err = 0, None
    for f in futures:
        try:
            nbytes += f.result()
        except (StorageError, OSError, ValueError) as e:
            err = err or e
    if err is not None:
        raise CheckpointError(f"{where}: rank {part.rank} failed to write its data: {err}") from err
    return nbytes, len(futures)


# ----------------------------------------------------------------------------------- commit


def try_commit(store: Store, step: int, attempt: str, world_size: int, extra: dict | None = None) -> bool:
    """Write the commit record if every rank of ``attempt`` has written its flat done record
    (``mf.done_key``, the layout before the done tree; writers now call :func:`finish_rank`).

    Called by each rank (or daemon) after its own done record is durable. Returns True for the
    one caller whose ``put_if_absent`` created the record. Listing after our own done record is
    written guarantees the last finisher sees them all (object stores list what was written).
    It lists and reads all N records: O(N) requests per rank, O(N^2) per save.
    """
    dones = list(store.list(mf.done_prefix(step, attempt)))
    if len(dones) < world_size:
        return False
    total = 0
    objects = 0
    for d in dones:
        rec = json.loads(store.get(d.key))
        total += rec.get("bytes", 0)
        objects += rec.get("objects", 0)
    record = {
        "step": step,
        "attempt": attempt,
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
    """Rank's part of the commit, once all its data is durable: write its done record (``record``
    with at least ``bytes`` and ``objects``) into the done tree (``ckptd.donetree``), then climb
    the tree; the rank that completes it writes ``commit.json`` (with ``extra`` in it). True for
    the one caller that created the commit record. O(log N) round trips, one LIST of at most
    64 keys per level, no GET of other ranks' records."""
    donetree.write_done(store, step, attempt, rank, record)

    def commit(nbytes: int, objects: int) -> bool:
        rec = {
            "step": step,
            "attempt": attempt,
            "world_size": world_size,
            "bytes": nbytes,
            "objects": objects,
            "time": time.time(),
            "done_layout": "tree",
            **(extra or {}),
        }
        won = commit_step(store, step, rec)
        if won:
            _write_notices(store, step, attempt, world_size)
        return won

    return donetree.climb(store, step, attempt, rank, world_size, commit)


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
    commit = f"{mf.step_dir(step)}/{mf.COMMIT}"
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
        own = notice is None or pick.random() < donetree.NOTICE_GROUP / world_size
        if store.exists(commit if own else notice):
            return
        if time.monotonic() > deadline:
            n = donetree.count_done(store, step, attempt)
            raise CheckpointError(
                f"{catalog.where(store, step)}: not committed after {timeout:.0f} s: {n} of {world_size} ranks finished"
            )
        time.sleep(next(delays))


# -------------------------------------------------------------------------------- retention


def after_commit(store: Store, result: SaveResult, keep_last: int | None) -> None:
    """The one retention convention: the writer that wrote the commit record applies retention,
    after it has reported the commit (so retention delays neither the caller nor the result)."""
    if result.committed_here and keep_last:
        apply_retention(store, keep_last)


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
    "Dedupe",
    "SaveResult",
    "after_commit",
    "apply_retention",
    "POLLS_PER_SECOND",
    "begin",
    "commit_step",
    "finish_rank",
    "manifest_objects",
    "persist",
    "poll_delays",
    "try_commit",
    "wait_commit",
]
