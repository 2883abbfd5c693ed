"""One rank's write of a checkpoint: its part (a :class:`ckptd.savejob.SaveJob`) claimed, written,
made durable and recorded done, so that the commit protocol can commit the step.

Every writer calls :func:`persist` -- the in-process background writer
(``trainer_hooks.writer.BackgroundWriter``), the ``ckptd serve`` daemon (``ckptd.server.jobs``)
-- and the streaming :class:`ckptd.stream.CheckpointWriter` (``ckptd import``, ``reshard
--rechunk``) calls the same steps -- so a save has one order of writes wherever it runs. For one
step, on every rank, on a background thread::

    persist(store, part, pool, writer=JOB)
      1. claim          rank 0: claims.lead_claim; the others: claims.follow_claim (one begin per
                        attempt); claim="each": claims.begin on every rank; claim="caller": the
                        caller claimed (the daemon: server.shared_claim.SharedClaim)
      2. write data     shards + metadata with put_new (create-only), in parallel (_write_data),
                        while a Heartbeat renews the attempt's lease on the step
      3. store.sync()   one durability barrier for all of it
      4. done record    donetree.write_done: this rank's data is durable
      5. commit.climb   climb the done tree; the rank that completes it checks the step and
                        writes commit.json once (ckptd.commit)
      6. commit.wait_commit   the others poll for it (bounded by commit_timeout; wait=False
                        leaves it to the caller: the daemon watches many jobs from one thread)
      on failure before 4: clean_up deletes what this rank wrote (best effort, logged)
    retention.after_commit(store, result, keep_last)   by the committing writer, afterwards

Invariants: no byte before a go of the claim (1); the done record (4) only after every object of
the rank is durable (3), and never once ``abort`` is set; a rank that fails before its done
record deletes the objects it wrote. Once its done record is durable the data is no longer its
own to retract: another rank may commit it. Metadata keys reserved for the protocol
(``manifest.is_reserved``) are refused.

Turning a shard's ``buffer`` into a numpy array is the caller's business (``to_numpy``): this
module knows numpy and the store, not torch. :class:`Dedupe` (incremental saves) reuses the
shards of the writer's previous committed step.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd.claims import LEADER, begin, check_abort, check_writer, follow_claim, lead_claim, owner
from ckptd.codec import encode_shard, image_crcs, image_digests, seal_image, shard_digests
from ckptd.commit import climb, wait_commit
from ckptd.errors import CheckpointError, SaveAborted
from ckptd.leases import Heartbeat
from ckptd.savejob import SaveJob
from storage_backends import ExistsError, StorageError, Store
from storage_backends.base import as_buffers, data_size

log = logging.getLogger("ckptd.persist")


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


def manifest_objects(manifest: mf.Manifest) -> list[tuple[str, bytes]]:
    """The metadata objects the writer of the manifest (rank 0) puts besides its shards: the
    zarr groups of the folder and ``manifest.json``, as ``(key in the folder, bytes)``."""
    return [*mf.group_nodes(manifest.tensors, manifest.step), (mf.MANIFEST, manifest.to_bytes())]


def persist(
    store: Store,
    part: SaveJob,
    pool: ThreadPoolExecutor,
    *,
    writer: str | None = None,
    commit_timeout: float = 1800.0,
    wait: bool = True,
    dedupe: Dedupe | None = None,
    to_numpy: Callable[[Any], np.ndarray] = np.asarray,
    abort: threading.Event | None = None,
    claim: str = "leader",
    heartbeat: bool = True,
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

    ``claim`` (step 1 of the module docstring; why: ``ckptd.claims``): ``"leader"`` (default)
    needs every rank of the attempt persisting, rank 0 included; the others wait for its
    outcome, bounded by ``commit_timeout`` and ``abort``. ``"each"``: for callers that may run a
    rank's part long before or after rank 0's, or cannot run them side by side (the daemon: its
    bounded upload workers could all be taken by parts that wait for a rank 0 queued behind them).
    ``"caller"``: the caller already claimed the step for this attempt and writer; ``persist``
    writes at once. The fencing still holds at the commit: the newest claim must name the attempt.

    ``heartbeat``: renew the attempt's lease on the step while this rank writes
    (:class:`ckptd.leases.Heartbeat`, a small thread); False only for simulations whose clock
    is virtual (``benchmarks.scale``), where no real thread may touch the store."""
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
        begin(store, part.step, part.attempt, writer, sole=part.world_size == 1)
    elif part.rank == LEADER:
        lead_claim(store, part.step, part.attempt, writer, part.world_size, pool)
    else:
        follow_claim(store, part.step, part.attempt, writer, part.rank, commit_timeout, abort)
    # the heartbeat renews the attempt's lease until this rank's part is done
    with Heartbeat(store, part.step, part.attempt, part.rank, abort=abort) if heartbeat else nullcontext():
        return _persist_claimed(
            store, part, pool, writer, where, dedupe, to_numpy, abort, commit_timeout, wait, t0, started_at
        )


def _persist_claimed(store, part, pool, writer, where, dedupe, to_numpy, abort, commit_timeout, wait, t0, started_at):
    """Steps 2-6 of :func:`persist`, once the step is claimed (under the attempt's heartbeat)."""
    written: list[str] = []
    tags: dict[str, object] = {}  # key -> identity of the object this rank created (put_new)
    try:
        nbytes, shard_keys, pins = _write_data(store, part, pool, dedupe, to_numpy, where, written, abort, tags)
        t_written = time.perf_counter()
        try:
            store.sync()
        except (StorageError, OSError) as e:
            raise CheckpointError(f"{where}: rank {part.rank} failed to make its data durable: {e}") from e
        check_abort(abort, where)
    except BaseException:
        clean_up(store, where, part.rank, written, tags, step=part.step, attempt=part.attempt)
        raise
    t_synced = time.perf_counter()
    record = {
        **part.done,  # the caller's fields first: the protocol's own cannot be overridden
        "rank": part.rank,
        "writer": writer,
        "bytes": nbytes,
        "objects": len(written),
        "shards": shard_keys,
        "pins": pins,
        "time": time.time(),
    }
    try:
        donetree.write_done(store, part.step, part.attempt, part.rank, record)
        check_abort(abort, where)
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


def _write_data(
    store: Store,
    part: SaveJob,
    pool: ThreadPoolExecutor,
    dedupe,
    to_numpy,
    where: str,
    written: list[str],
    abort,
    tags: dict[str, object],
) -> tuple[int, list[str], dict]:
    """Put every shard and metadata object of ``part``, create-only: a key already taken (a
    superseded attempt's late write) fails the save, never mixes it. Not yet durable: one
    ``sync`` follows (on a filesystem one syncfs, not an fsync per file and folder). Appends each
    key to ``written`` before putting it (a failed put may leave it) and the identity of each
    object it created to ``tags``. Returns the bytes written, the shard object keys (relative to
    the step folder) and the pins for the done record (``donetree.make_pins``; a deduplicated
    shard's are its source's, since its bytes are the same)."""
    folder = mf.step_dir(part.step)
    lock = threading.Lock()
    shard_pins: dict[str, tuple[int, bytes, bytes]] = {}

    def put(key: str, data) -> None:
        check_abort(abort, where)
        with lock:
            written.append(key)
        try:
            tag = store.put_new(key, data)
        except ExistsError:
            if not _holds(store, key, data):
                raise
            return  # an earlier try of this attempt (a retried persist) wrote these very bytes
        with lock:
            tags[key] = tag

    def put_meta(key: str, data: bytes) -> int:
        put(f"{folder}/{key}", data)
        return len(data)

    def put_shard(sw) -> int:
        key = f"{folder}/{sw.object_key}"
        if sw.image is not None:  # staged as the object itself: checksum it in place, send it whole
            data = to_numpy(sw.image)
            seal_image(sw.layout, data, sw.chunks)
            bufs = [memoryview(data)]
            pin = image_crcs(sw.layout, data, sw.chunks)
        else:
            data = to_numpy(sw.buffer)
            bufs = encode_shard(sw.layout, sw.coord, data)
            pin = b"".join(bytes(b) for b in bufs[1::2])  # each chunk's crc, then the index's

        def record_pins() -> bytes | None:
            """The shard's BLAKE3 pins, recorded with its crc32c pins for the done record."""
            parts = image_digests(sw.layout, data, sw.chunks) if sw.image is not None else shard_digests(bufs)
            with lock:
                shard_pins[sw.object_key] = (data_size(bufs), pin, parts)
            return parts

        if dedupe is not None:
            digest = dedupe.digest(sw, data, record_pins())  # the pins name the content: no second pass
            check_abort(abort, where)
            if dedupe.try_reuse(store, sw.object_key, digest, key):
                with lock:
                    written.append(key)
                return 0  # unchanged since the last commit: linked/copied, no bytes written
            put(key, bufs)
            return data_size(bufs)
        # The BLAKE3 pins go into the done record only, after every put: hashing after the put
        # lets the store's I/O (a disk's DMA, an upload) of this shard start before its hash,
        # and overlap the hashing of the shards still queued on the pool.
        put(key, bufs)
        record_pins()
        return data_size(bufs)

    for key, _ in part.metadata:
        if mf.is_reserved(key):
            raise CheckpointError(f"{where}: metadata key {key!r} is reserved for the commit protocol")
    # Largest first, the small metadata objects last: a big shard queued behind the others
    # would otherwise be the one request still running while the rest of the pool idles.
    futures = [pool.submit(put_shard, sw) for sw in sorted(part.shards, key=lambda sw: -sw.buffer.nbytes)]
    futures += [pool.submit(put_meta, k, d) for k, d in part.metadata]
    nbytes, err = 0, None
    for f in futures:
        try:
            nbytes += f.result()
        except (StorageError, OSError, ValueError, CheckpointError) as e:
            err = err or e
    if err is not None:
        if isinstance(err, SaveAborted):
            raise err
        if isinstance(err, ExistsError):
            raise CheckpointError(
                f"{where}: rank {part.rank} found an object of step {part.step} written by another attempt "
                f"({err}): a superseded writer of step {part.step} is still writing; retried saves will take "
                "it over"
            ) from err
        raise CheckpointError(f"{where}: rank {part.rank} failed to write its data: {err}") from err
    pins = donetree.make_pins(shard_pins, dict(part.metadata))
    return nbytes, [sw.object_key for sw in part.shards], pins


def _holds(store: Store, key: str, data) -> bool:
    """Whether the object at ``key`` is exactly ``data`` (read back in 8 MiB ranges): a put
    retried with the same attempt (the daemon's upload retries, a resumed job) meets what its
    first try wrote. Identical bytes are harmless whoever wrote them; it is not this call's
    object, so it gets no identity and this rank's cleanup never deletes it."""
    views = as_buffers(data)
    size = sum(v.nbytes for v in views)
    try:
        if store.head(key).size != size:
            return False
        pos = 0
        for v in views:
            for off in range(0, v.nbytes, 8 << 20):
                part = v[off : off + (8 << 20)]
                if store.get_range(key, pos, part.nbytes) != part:
                    return False
                pos += part.nbytes
    except StorageError:
        return False
    return True


def clean_up(
    store: Store,
    where: str,
    rank: int,
    keys: list[str],
    tags: dict[str, object] | None = None,
    *,
    step: int | None = None,
    attempt: str | None = None,
) -> None:
    """Best effort: delete what this rank wrote of a save that failed before its done record
    (a disk-full episode must not leave partial data that blocks the next saves).

    With ``tags`` (the identities ``put_new`` returned), only those objects, each with
    ``delete_if``: never by key alone, so an object another attempt wrote under the same key
    since is kept. With ``step`` and ``attempt``: an attempt whose claim is no longer the
    step's newest (it was superseded: another writer owns the step now) deletes nothing."""
    if step is not None and attempt is not None:
        try:
            rec = owner(store, step)
        except (StorageError, CheckpointError) as e:
            log.warning(
                "%s: rank %d's save failed; cannot tell who owns the step (%s): deleting nothing", where, rank, e
            )
            return
        if rec is None or rec.get("attempt") != attempt:
            log.warning("%s: rank %d's save failed and its attempt was superseded: deleting nothing", where, rank)
            return
    failed = 0
    for key in keys:
        try:
            if tags is None:
                store.delete(key)
            elif key not in tags or not store.delete_if(key, tags[key]):
                failed += 1
        except StorageError:
            failed += 1
    if keys:
        n = len(keys)
        log.warning("%s: rank %d's save failed; deleted %d of the %d objects it wrote", where, rank, n - failed, n)


class Dedupe:
    """Content hashes of the last committed save of this writer: per shard, a sha256 of its
    layout and of its parts' BLAKE3 pins (which the done record needs anyway), or of its data
    where a writer makes no pins.

    Exact reuse needs a strong hash: a collision would silently keep stale data, so no crc.
    """

    def __init__(self):
        self._committed: dict[str, tuple[int, str]] = {}  # object key -> (step, digest)
        self._pending: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self.reused = 0

    def digest(self, sw, data: np.ndarray, parts: bytes | None = None) -> str:
        """The content hash of shard ``sw`` holding ``data``. ``parts``: the shard's BLAKE3
        pins (``codec.image_digests``/``shard_digests``), which already name every byte of the
        object as stored: hashing them costs nothing, where a sha256 over ``data`` ran at
        ~1 GB/s beside the pins' ~2.5 GB/s."""
        h = hashlib.sha256(repr(sw.layout).encode())  # dtype, shapes, chunking
        h.update(b"blake3:" + parts if parts is not None else memoryview(data.reshape(-1).view("u1")))
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


__all__ = ["Dedupe", "SaveResult", "clean_up", "manifest_objects", "persist"]
