"""The daemon mode's ``Stager``: snapshot buffers as files of a staging lease in shared memory.

The first buffer of a save acquires the rank's staging lease (a folder the daemon grants, in
``/dev/shm`` by default) or creates one; buffers are files in it, mapped as tensors, so the
snapshot copy *is* the copy into shared memory. The same files are reused by the next save once
the daemon hands the lease back (no new pages to fault in). When the daemon's memory budget is
full it answers 429 and the save waits, saying why in the log. ``finish`` writes the job's
metadata objects into the lease too and returns the file list that ``daemon_sink`` hands off.

Trainer and daemon must see the same staging folder (same node; in containers, the same host
``/dev/shm`` mount). Concurrency: the training thread calls ``buffer``/``image``/``finish``;
the sink's poller thread may call ``lease_lost``. Nothing writes into the lease's files while
the daemon owns it (between the hand-off and the next save's acquire).
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import threading
from pathlib import Path

import torch

from ckptd.codec import ArrayLayout, image_nbytes
from ckptd.daemon_conn import DaemonConnection, detail
from ckptd.errors import CheckpointError
from ckptd.savejob import SaveJob, format_image
from trainer_hooks.snapshot import Stager, staged_image_chunks

__all__ = ["DaemonStager"]


# Staged files are created, never opened if they exist (O_EXCL: a name someone planted, a link
# above all, is refused instead of written through). In a lease folder this user owns (the
# daemon gave it to us, or runs as us) they are 0600: nobody else reads them but the daemon, by
# its capabilities. In a folder of the trainers' group (a daemon of another user without those
# capabilities; 3770) they are 0640, for the daemon to read, and the group's members can too.
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
STAGED_FILE_MODE = 0o640  # in a folder of the group
PRIVATE_FILE_MODE = 0o600  # in a folder of our own


def _write_new(path, data: bytes, mode: int = STAGED_FILE_MODE) -> None:
    """Replace ``path`` with a new file holding ``data``: the old name (a file of the previous
    save, or a link planted in its place) is unlinked, never followed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, _CREATE, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _identity(path) -> tuple | None:
    """What tells a staged file apart from one put in its place since: inode, mtime, size
    (None: not a regular file, or gone)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None


class DaemonStager(Stager):
    """Snapshot buffers as files of a staging lease, mapped as tensors and reused across saves.

    ``pin`` is ignored: the buffers are shared-memory mappings, which CUDA copies into
    synchronously (the copy is correct, only not overlapped). Object images are files of the
    lease too: the daemon checks their size against the layout, rewrites the index, fills in the
    checksums in its private mapping and writes the file's pages as they are."""

    def __init__(self, client: DaemonConnection, root: str, rank: int, client_id: str):
        super().__init__()
        self._client = client
        self._root, self._rank, self._client_id = root, rank, client_id
        self.lease_ttl = 60.0  # as the daemon granted it: the sink heartbeats well within it
        self.lease_id: str | None = None
        self._dir: Path | None = None
        self._file_mode = STAGED_FILE_MODE
        self._granted = 0
        self._files: dict[tuple[str, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
        # object images among them: (key, coord) -> (layout, dtype, chunked view of the file)
        self._views: dict[tuple[str, tuple[int, ...]], tuple[ArrayLayout, torch.dtype, torch.Tensor]] = {}
        self._meta_names: list[str] = []
        self._meta_bytes = 0
        # name -> (the bytes this client wrote to it in the lease, that file's identity)
        self._meta_written: dict[str, tuple[bytes, tuple | None]] = {}
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
            chunks = staged_image_chunks(layout, coord, dtype)
            if chunks is None:
                return None
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
        fd = os.open(self._dir / name, _CREATE, self._file_mode)
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
        self._meta_names, self._meta_bytes, self._meta_written = [], 0, {}
        self.lease_id, self._dir, self._granted = None, None, 0

    def _begin(self) -> None:
        if self._in_save:  # begun by an earlier buffer of this save
            return
        self._in_save, self._used = True, set()
        if self.lease_id is None:
            return
        status, body, _ = self._client.call("POST", f"/v1/leases/{self.lease_id}/acquire", patient=True)
        if status == 200:
            self._granted = body["bytes"]
            return
        if status == 409:  # an earlier job still reads it (that save failed or timed out here)
            self._client.call("DELETE", f"/v1/leases/{self.lease_id}")
        elif status != 404:
            raise CheckpointError(f"ckptd daemon at {self._client.url}: cannot reuse staging lease: {detail(body)}")
        self._forget_lease()

    def _ensure(self, total: int) -> None:
        """Make the lease hold ``total`` bytes, waiting while the daemon's budget is full."""
        if self.lease_id is not None and total <= self._granted:
            return
        if self.lease_id is None:
            want = max(total, self._last_total)
            body = self._client.call_waiting(
                "POST",
                "/v1/leases",
                {
                    "root": self._root,
                    "rank": self._rank,
                    "bytes": total,
                    "want": want,
                    "client": self._client_id,
                },
            )
            self.lease_id, self._dir = body["lease"], Path(body["dir"])
            try:
                mine = os.stat(self._dir).st_uid == os.geteuid()
            except OSError:
                mine = False  # a folder we cannot stat we cannot write either: the create says why
            self._file_mode = PRIVATE_FILE_MODE if mine else STAGED_FILE_MODE
            self.lease_ttl = float(body.get("ttl_s", 60.0))
        else:
            need = total - self._granted
            want = max(need, self._last_total - self._granted, self._granted)  # geometric growth
            body = self._client.call_waiting("POST", f"/v1/leases/{self.lease_id}/grow", {"bytes": need, "want": want})
        self._granted = body["bytes"]

    def finish(self, job: SaveJob) -> tuple[str, list[dict], list[dict]]:
        """(lease, the job's shard files, its metadata files), written into the lease; files of
        tensors this save no longer has are deleted."""
        with self._lock:
            self._begin()
            shards = []
            for sw in job.shards:
                hit = self._files.get((sw.key, sw.coord))
                if hit is None or hit[1] is not (sw.buffer if sw.image is None else sw.image):
                    raise CheckpointError(f"array {sw.key!r}: snapshot buffer is not in the staging lease")
                shard = {"key": sw.key, "layout": sw.layout.to_json(), "coord": list(sw.coord), "file": hit[0]}
                if sw.image is not None:
                    shard["image"] = True
                shards.append(shard)
            for k in [k for k, (name, _) in self._files.items() if name not in self._used]:
                self._drop(*k)
            meta_bytes = sum(len(d) for _, d in job.metadata)
            self._meta_bytes = 0
            self._ensure(self._allocated() + meta_bytes)  # creates the lease if the job has no buffers
            metadata = []
            written, previous, self._meta_written = {}, self._meta_written, {}  # unknown until all are written
            for i, (key, data) in enumerate(job.metadata):
                name = f"meta_{i:06d}.bin"
                # Most metadata (each array's zarr.json) is the same bytes save after save: a file
                # this lease holds from the previous save with those bytes stays as it is, if it is
                # still the very file written then (same inode and mtime: not replaced, not a link).
                path = self._dir / name
                seen = previous.get(name)
                if seen is None or seen[0] != data or _identity(path) != seen[1]:
                    _write_new(path, data, self._file_mode)
                    seen = (data, _identity(path))
                written[name] = seen
                metadata.append({"key": key, "file": name})
            for name in self._meta_names[len(job.metadata) :]:
                with contextlib.suppress(OSError):
                    os.unlink(self._dir / name)
            self._meta_names = [m["file"] for m in metadata]
            self._meta_written = written
            self._meta_bytes = meta_bytes
            self._last_total = self._allocated()
            self._in_save = False
            return self.lease_id, shards, metadata
