"""The memory tier's copies on local disk (``--spill-dir``): a restarted daemon serves them again.

Every complete copy of the tier table (``server.tiers``: an own memory-only part or hot copy, or
a replica of either) is also written, by one background thread (never on a save's path), to one
file of the spill folder: ``MAGIC``, the header's length (4 bytes, little endian), the header
(JSON: root, step, attempt, rank, source, kind, a memory-only part's MAC, and each object's key,
size and crc32c), then the
objects' bytes in that order. Each file is created ``O_EXCL | O_NOFOLLOW``, 0600, under a
temporary name, written, fsynced, renamed into place, and the folder fsynced. A dropped copy's
file is removed by the same thread, after its write (the one queue keeps them in order).

On start (``Tiers.adopt``) each file is read back without following a link or blocking on a FIFO,
only if it is a regular file of this user with one link and at most the staging budget; its
header passes the checks a pushed replica's does (``replication.check_objects``) and every
object its crc32c; a memory-only part also its MAC (``Replication.check_mac``: made by a daemon
of the ring for its root's binding, so a file planted in the folder is not adopted) and its
objects the pins of its rank's done record (``commit.check_pins``). A file that fails is
logged once and removed, never served. Names that are not a spill file's are left alone
(logged once).

The folder (docs/operations.md, "Spill folder") must be a real folder of the daemon's user, not
writable by its group or others (else the daemon refuses to start), and one daemon's alone (a
lock file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import queue
import re
import stat
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckptd.server.safefiles import StagingError, check_ancestors

__all__ = ["HEADER_CAP", "MAGIC", "Spill", "SpillError"]

log = logging.getLogger("ckptd.tiers")

MAGIC = b"CKPTDSP1"
HEADER_CAP = 16 << 20  # bytes of a file's header at most
NAME = re.compile(r"[0-9a-f]{32}\.spill", re.ASCII)
TMP = re.compile(r"\.[0-9a-f]{32}\.spill\.tmp", re.ASCII)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SpillError(ValueError):
    """A spill file is not one this daemon wrote whole (a link, another user's, corrupt)."""


class Spill:
    """The spill folder ``path``: StagingError (the daemon does not start) unless it is a real
    folder of this user that its group and others cannot write, with safe folders above it."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        try:
            check_ancestors(self.path)
            self.fd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            raise StagingError(f"spill folder {self.path} does not exist (create it: mkdir -m 700)") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise StagingError(
                    f"spill folder {self.path} is a symbolic link or not a folder: refusing it"
                ) from None
            raise StagingError(f"spill folder {self.path}: {e.strerror or e}") from None
        try:
            st = os.fstat(self.fd)
            if st.st_uid != os.geteuid():
                raise StagingError(
                    f"spill folder {self.path} belongs to uid {st.st_uid}, not to this daemon (uid {os.geteuid()})"
                )
            if st.st_mode & 0o022:
                raise StagingError(
                    f"spill folder {self.path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                    f"chmod go-w {self.path}"
                )
            lock = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            self._lock_fd = lock
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(lock)
                raise StagingError(f"another ckptd serve already uses the spill folder {self.path}") from None
        except BaseException:
            os.close(self.fd)
            raise
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # ----------------------------------------------------------------------------- writing

    def new_name(self) -> str:
        return f"{uuid.uuid4().hex}.spill"

    def later(self, job) -> None:
        """Run ``job()`` on the spill thread, after every job queued before it."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptd-tier-spill", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a disk that fails must not stop the daemon
                log.exception("memory tier: a spill to %s failed", self.path)

    def write(self, name: str, header: dict, buffers: list) -> None:
        """``name``: ``MAGIC``, the header, then ``buffers``, fsynced, renamed into place."""
        head = json.dumps(header, separators=(",", ":")).encode()
        tmp = f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                for buf in buffers:
                    f.write(memoryview(buf))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.remove(tmp)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        os.fsync(self.fd)

    def remove(self, name: str) -> None:
        """Unlink ``name`` in the folder (a link is unlinked, never followed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    # ----------------------------------------------------------------------------- reading

    def names(self) -> Iterator[str]:
        """The spill files in the folder; left-over temporary files are removed, other names
        logged once and left alone."""
        for name in sorted(os.listdir(self.fd)):
            if NAME.fullmatch(name):
                yield name
            elif TMP.fullmatch(name):
                self.remove(name)  # a write the daemon did not finish
            elif name != ".lock":
                log.warning("spill folder %s: %r is not a spill file: left alone, not read", self.path, name)

    def read(self, name: str, cap: int, into) -> tuple[dict, list]:
        """The header of ``name`` and its objects, each read into ``into(size)`` (a writable
        buffer); SpillError (or OSError) unless the file is a regular file of this user with one
        link, at most ``cap`` bytes, and its header adds up to its size."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SpillError("not a regular file")
            if st.st_uid != os.geteuid() or st.st_nlink != 1:
                raise SpillError(f"owned by uid {st.st_uid} with {st.st_nlink} links, not this daemon's own file")
            if st.st_size > cap:
                raise SpillError(f"{st.st_size} bytes, more than the staging budget ({cap})")
            with open(fd, "rb", closefd=False) as f:
                lead = f.read(len(MAGIC) + 4)
                if len(lead) != len(MAGIC) + 4 or lead[: len(MAGIC)] != MAGIC:
                    raise SpillError("not a spill file (no magic)")
                (n,) = struct.unpack("<I", lead[len(MAGIC) :])
                if n > HEADER_CAP:
                    raise SpillError(f"a header of {n} bytes")
                header = json.loads(f.read(n))
                if not isinstance(header, dict) or not isinstance(header.get("objects"), list):
                    raise SpillError("malformed header")
                sizes = [int(o[1]) for o in header["objects"]]
                if any(s < 0 for s in sizes) or len(lead) + n + sum(sizes) != st.st_size:
                    raise SpillError("its objects do not add up to its size")
                out = []
                for size in sizes:
                    buf = into(size)
                    if size and f.readinto(memoryview(buf)) != size:
                        raise SpillError("shrank while it was read")
                    out.append(buf)
            return header, out
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in (self._lock_fd, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
