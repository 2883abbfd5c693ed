"""Write a committed checkpoint from one process, one tensor (or one shard) at a time.

For tools that produce checkpoints outside a training job -- ``ckptd import``, ``ckptd reshard
--rechunk`` -- with memory bounded by the largest shard, not the whole checkpoint. It follows the
same format and commit protocol (:mod:`ckptd.commit`: ``begin``, data, manifest, done records,
then one ``commit.json`` written with put_if_absent) as the trainer hooks, as a world of one
writer::

    with CheckpointWriter(store, step=100) as w:
        w.write_tensor("model/fc.weight", array)          # numpy or torch (CPU)
        w.set_state({"model": {"kind": "module", "data": {...}}})
    # committed on a clean exit; left partial (never committed) if the block raised
"""

from __future__ import annotations

import math
import socket
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptd import catalog, claims, commit, donetree, leases, persist
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, encode_shard, shard_digests
from ckptd.dtypes import as_numpy, zarr_name
from ckptd.errors import CheckpointError
from ckptd.layout import choose_chunk_shape
from storage_backends import Store
from storage_backends.base import data_size

__all__ = ["CheckpointWriter", "MAX_SHARD_BYTES", "default_layout"]

MAX_SHARD_BYTES = 256 * 1024 * 1024  # bigger tensors are split along dim 0 into several objects
MAX_PENDING_OBJECTS = 4096  # puts in flight, whatever their size (each holds a future and its data)


def default_layout(shape: tuple[int, ...], dtype: str, itemsize: int) -> ArrayLayout:
    """One shard per tensor up to MAX_SHARD_BYTES, else even dim-0 shards; inner chunks of a few
    MiB so readers at any world size fetch little more than they need."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return ArrayLayout.empty(shape, dtype)
    nbytes = math.prod(shape) * itemsize
    shard = shape
    if shape and nbytes > MAX_SHARD_BYTES and shape[0] > 1:
        n = min(shape[0], -(-nbytes // MAX_SHARD_BYTES))
        shard = (-(-shape[0] // n), *shape[1:])
    return ArrayLayout(shape, dtype, shard, choose_chunk_shape(shard, itemsize))


class CheckpointWriter:
    def __init__(
        self,
        store: Store,
        step: int,
        *,
        world_size: int = 1,
        layout_info: dict | None = None,
        threads: int = 8,
        max_pending_bytes: int = 512 * 1024 * 1024,
        writer: str | None = None,
    ):
        """``world_size`` is what ``ls`` reports as the world size at save (an import has none;
        a rechunk keeps the target size). Puts run on ``threads`` threads with at most
        ``max_pending_bytes`` of encoded shards in flight. ``writer``: the job id that claims
        the step (``ckptd.claims.begin``; default ``ckptd@<host>``, so a failed import or rechunk
        run again on the same host takes its own leftovers over). A committed step, or one that
        another writer is writing, is refused here, before a byte is written. A failure (an
        exception in the ``with`` block or in ``commit``) deletes what this writer wrote."""
        self.store = store
        self.step = step
        self.world_size = world_size
        self.layout_info = layout_info or {}
        self.attempt = uuid.uuid4().hex[:12]
        self.entries: dict[str, mf.TensorEntry] = {}
        self.state: dict[str, Any] = {}
        self.bytes = 0
        self.objects = 0
        self._folder = mf.step_dir(step)
        self._pending: deque[tuple[Future, int]] = deque()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._committed = False
        self._shards: list[str] = []
        self._shard_pins: dict[str, tuple[int, bytes, bytes]] = {}  # the done record's pins (donetree.make_pins)
        self._meta: dict[str, bytes] = {}
        self._written: list[str] = []
        self._tags: dict[str, object] = {}  # identities of the objects put_new created, for clean_up
        self.writer = writer or f"ckptd@{socket.gethostname()}"
        claims.begin(store, step, self.attempt, claims.check_writer(self.writer))
        self._heartbeat = leases.Heartbeat(store, step, self.attempt, 0).__enter__()  # renews the lease
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptd-stream")

    def _put_new(self, key: str, data, pin=None) -> None:
        self._tags[key] = self.store.put_new(key, data)  # create-only: never over another writer's
        if pin is not None:
            pin()

    def _put(self, key: str, data, nbytes: int, pin=None) -> None:
        """Put ``data`` at ``key`` on the pool; then ``pin()``, on the same thread."""
        self._written.append(f"{self._folder}/{key}")
        self._pending.append((self._pool.submit(self._put_new, f"{self._folder}/{key}", data, pin), nbytes))
        self._pending_bytes += nbytes
        self.bytes += nbytes
        self.objects += 1
        # Bounded in bytes and in objects, with a running total: summing the queue on each put
        # made an import of many small arrays quadratic (300k empty tensors: over 20 minutes).
        while self._pending and (self._pending_bytes > self._max_pending or len(self._pending) > MAX_PENDING_OBJECTS):
            self._drain(1)

    def _drain(self, n: int | None = None) -> None:
        for _ in range(len(self._pending) if n is None else min(n, len(self._pending))):
            f, nbytes = self._pending.popleft()
            self._pending_bytes -= nbytes
            f.result()

    def declare(self, key: str, layout: ArrayLayout, placements: str = "") -> None:
        """Register an array (and write its zarr.json) before writing its shards."""
        if key in self.entries:
            raise CheckpointError(f"key {key!r} written twice")
        self.entries[key] = mf.TensorEntry(key, layout, placements)
        meta = mf.dumps(layout.metadata())
        self._meta[f"{mf.array_path(key)}/zarr.json"] = meta
        self._put(f"{mf.array_path(key)}/zarr.json", meta, len(meta))

    def write_shard(self, key: str, coord: tuple[int, ...], block: np.ndarray) -> None:
        """Write one shard of a declared array; ``block`` is the shard's data clipped to the array.
        The block must stay unchanged until ``close``/``commit`` (it is written asynchronously)."""
        layout = self.entries[key].layout
        bufs = encode_shard(layout, coord, block)
        name = f"{mf.array_path(key)}/{layout.shard_key(coord)}"
        size = data_size(bufs)
        self._shards.append(name)
        crcs = b"".join(bytes(b) for b in bufs[1::2])

        def pin() -> None:  # BLAKE3 on the pool's threads, after the put: beside the other puts
            self._shard_pins[name] = (size, crcs, shard_digests(bufs))

        self._put(name, bufs, size, pin)

    def write_tensor(self, key: str, array, layout: ArrayLayout | None = None, placements: str = "") -> None:
        """Write a whole tensor (numpy array or CPU torch tensor)."""
        arr = array if isinstance(array, np.ndarray) else as_numpy(array.detach().cpu().contiguous())
        dtype = zarr_name(arr.dtype)
        layout = layout or default_layout(arr.shape, dtype, arr.dtype.itemsize)
        self.declare(key, layout, placements)
        for coord in layout.shard_coords() if arr.size else ():
            self.write_shard(key, coord, arr[tuple(map(slice, *layout.shard_box(coord)))])

    def set_state(self, tree: dict[str, Any]) -> None:
        """The manifest's state tree: ``{name: {"kind": ..., "data": <jsonenc with $tensor refs>}}``."""
        self.state = tree

    def commit(self, extra: dict | None = None) -> None:
        self._drain()
        m = mf.Manifest(self.step, self.world_size, self.entries, self.state, self.attempt, layout=self.layout_info)
        for key, data in persist.manifest_objects(m):
            self._meta[key] = data
            self._put(key, data, len(data))
        self._drain()
        self.store.sync()  # everything above is durable before any done record
        committed = False
        for rank in range(self.world_size):  # the done records a commit of this world size needs
            mine = rank == 0  # rank 0's record accounts for everything this writer wrote
            rec = {
                "rank": rank,
                "writer": self.writer,
                "bytes": self.bytes if mine else 0,
                "objects": self.objects if mine else 0,
                "shards": self._shards if mine else [],
                "pins": donetree.make_pins(self._shard_pins, self._meta) if mine else donetree.make_pins({}, {}),
            }
            self._written.append(donetree.record_key(self.step, self.attempt, rank, rec))
            committed = commit.finish_rank(self.store, self.step, self.attempt, rank, self.world_size, rec, extra)
        if not committed:
            raise CheckpointError(f"{catalog.where(self.store, self.step)}: commit lost a race with another writer")
        self._committed = True

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)
            self._heartbeat.__exit__()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            try:
                if exc_type is None and not self._committed:
                    self.commit()
            finally:
                self.close()
        finally:
            if not self._committed:
                where = catalog.where(self.store, self.step)
                persist.clean_up(self.store, where, 0, self._written, self._tags, step=self.step, attempt=self.attempt)
