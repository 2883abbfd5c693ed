"""Files in a folder other local users can reach (``/dev/shm``), handled without trusting them.

Invariant: the daemon never follows a link, blocks on a FIFO, reads another user's file or
writes through a name someone else planted, in its staging folder and below. Folders are
created or adopted by :func:`open_private_dir` only (everything below is opened relative to its
descriptor), the folders above are checked by :func:`check_ancestors`, files are read by
:func:`read_staged` and records written by :func:`write_json_atomic`. A folder that is not safe
to use is a ``StagingError`` naming it and why; docs/security.md argues the threats.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import uuid
from pathlib import Path

__all__ = [
    "MAX_JOURNAL_BYTES",
    "StagingError",
    "StagingFileError",
    "check_ancestors",
    "open_private_dir",
    "read_staged",
    "write_json_atomic",
]

MAX_JOURNAL_BYTES = 16 << 20  # lease.json / job.json: a job's description, never more
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StagingError(RuntimeError):
    """The staging folder is not safe to use (another user's, a link, writable by others)."""


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``path`` through a fresh temp file (``O_EXCL | O_NOFOLLOW``: never through a link a
    client planted in its lease folder), then rename it into place."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    dfd = os.open(path.parent, _DIR_FLAGS)
    try:
        tmp = f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


class StagingFileError(OSError):
    """A staged file is not what the hand-off said (a link, a FIFO, another size)."""


def read_staged(path: Path, nbytes: int | None = None, cap: int = MAX_JOURNAL_BYTES, owner: int | None = None) -> bytes:
    """The bytes of a file in the staging area, read safely: ``O_NOFOLLOW`` (a link is refused,
    never followed: ``/proc/self/environ`` must not end up in a checkpoint), ``O_NONBLOCK`` (a FIFO
    cannot hang the daemon), then ``fstat`` on that descriptor: a regular file, of ``nbytes``
    bytes when given, at most ``cap``, owned by ``owner`` when given (another user's file, a hard
    link to one above all, is refused); then every byte is read from that same descriptor. Raises
    OSError (ELOOP, ENOENT, ...) or ``StagingFileError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StagingFileError(f"staging file {path} is not a regular file")
        if owner is not None and st.st_uid != owner:
            raise StagingFileError(f"staging file {path} belongs to uid {st.st_uid}, not to uid {owner}")
        if nbytes is not None and st.st_size != nbytes:
            raise StagingFileError(f"staging file {path} changed: {st.st_size} bytes, expected {nbytes}")
        if st.st_size > cap:
            raise StagingFileError(f"staging file {path} is {st.st_size} bytes, more than {cap}")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size)  # repeated reads until that many bytes, or the end
        if len(data) != st.st_size:
            raise StagingFileError(f"staging file {path} shrank while it was read")
        return data
    finally:
        os.close(fd)


def check_ancestors(path: Path) -> None:
    """Every folder above the staging folder must be safe from other users: owned by root or by
    us, and not writable by others unless sticky (``/dev/shm``, ``/tmp``), as ssh's StrictModes
    checks. Links above are resolved (``/var/run`` -> ``/run``) since only root or we could have
    made them there."""
    me = os.geteuid()
    for d in [path.parent.resolve(), *path.parent.resolve().parents]:
        st = os.stat(d)
        if st.st_uid not in (0, me):
            raise StagingError(f"{path}: {d} belongs to uid {st.st_uid}, not to root or this daemon")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise StagingError(f"{path}: {d} is writable by other users and not sticky")


def open_private_dir(name: str | Path, mode: int, gid: int | None = None, dir_fd: int | None = None) -> int:
    """Create the folder ``name`` (relative to ``dir_fd`` when given), or adopt it only if it is a
    real folder owned by this user; set its mode (and group); return an ``O_NOFOLLOW`` descriptor
    of it. Never ``exist_ok`` on a path someone else owns: a folder (or a link) pre-created by
    another local user is refused with StagingError."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StagingError(f"staging folder {name} is a symbolic link or not a folder: refusing it") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StagingError(
                f"staging folder {name} belongs to uid {st.st_uid}, not to this daemon (uid {os.geteuid()}): "
                "refusing to use it (remove it, or give another --staging-dir)"
            )
        if gid is not None and st.st_gid != gid:
            os.fchown(fd, -1, gid)
        if stat.S_IMODE(st.st_mode) != mode or gid is not None:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd
