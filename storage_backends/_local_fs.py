"""The local store's filesystem primitives: descriptor-relative folder walks, vectored I/O,
syncfs, and the identity of a file.

Invariants: nothing below a store's root is followed through a symbolic link: every folder is
opened from its parent's descriptor with ``O_NOFOLLOW`` (``open_child``, ``walk_down``) and every
file with ``O_NOFOLLOW | O_NONBLOCK`` (``FILE_OPEN``), so a link or a FIFO planted there is never
entered nor blocks. A folder made on the way is reported to the caller, which makes its name
durable (fsync of the parent) before it relies on it. A file's identity is (st_dev, st_ino,
st_mtime_ns, st_size): the inode number alone may be reused by a file made after ours. Temp
files are ``.{name}.tmp.*`` and are never objects (``is_temp``). No state here: ``LocalStore``
(``storage_backends.local``) builds on these.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Sequence

__all__ = [
    "DIR_OPEN",
    "DIR_RACE_TRIES",
    "FILE_OPEN",
    "NEW_FILE",
    "NO_LINK_ERRNOS",
    "advance",
    "copy_file",
    "enter",
    "entries",
    "gone",
    "identity",
    "is_temp",
    "open_child",
    "preadv_all",
    "syncfs",
    "walk_down",
    "write_temp",
    "writev_all",
]

IOV_MAX = 1024  # the most buffers one writev/preadv takes (Linux's UIO_MAXIOV)

# os.link failures that mean "this filesystem has no hard links", not "the key exists".
NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}

# How often a write retries when concurrent deletes keep pruning the folder it writes into.
DIR_RACE_TRIES = 20


try:
    syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    syncfs.argtypes = [ctypes.c_int]
    syncfs.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: fall back to sync(2)
    syncfs = None


def gone(e: OSError) -> bool:
    """Whether ``e`` says no object or folder of the store is there: the name is missing, or a
    folder, a file or a link stands where the other was expected (links are never followed)."""
    return isinstance(e, FileNotFoundError | NotADirectoryError | IsADirectoryError) or e.errno == errno.ELOOP


def is_temp(name: str) -> bool:
    return name.startswith(".") and ".tmp." in name


def advance(views: list[memoryview], i: int, off: int, n: int) -> tuple[int, int]:
    """Move the (buffer index, offset) cursor ``n`` bytes forward."""
    while n:
        rest = views[i].nbytes - off
        if n < rest:
            return i, off + n
        n -= rest
        i, off = i + 1, 0
    return i, off


def _batch(views: list[memoryview], i: int, off: int) -> list[memoryview]:
    return [views[i][off:], *views[i + 1 : i + IOV_MAX]]


def writev_all(fd: int, views: list[memoryview]) -> None:
    """Write every view, IOV_MAX at a time, resuming after partial writes."""
    i = off = 0
    while i < len(views):
        n = os.writev(fd, _batch(views, i, off))
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        i, off = advance(views, i, off, n)


def preadv_all(fd: int, views: list[memoryview], pos: int) -> int:
    """Fill every view from ``pos``, resuming after partial reads; returns the bytes read (less
    than asked only at end of file)."""
    i = off = total = 0
    while i < len(views):
        n = os.preadv(fd, _batch(views, i, off), pos + total)
        if n == 0:
            break
        total += n
        i, off = advance(views, i, off, n)
    return total


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_child(fd: int, name: str, create: bool) -> tuple[int, bool]:
    """The folder ``name`` in the folder ``fd``, opened ``O_NOFOLLOW``; if missing and
    ``create``, made first. Returns (its descriptor, whether it was missing): the caller makes a
    missing one's name durable (fsync of ``fd``), also when another thread made it meanwhile (it
    may not have fsynced the parent yet, and our put must not return before the name is durable).
    Raises OSError: ENOENT when missing and not ``create``, ELOOP/ENOTDIR for a link or a file."""
    try:
        return os.open(name, DIR_OPEN, dir_fd=fd), False
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=fd)
    return os.open(name, DIR_OPEN, dir_fd=fd), True


# A new temp file: never an existing name, never through a link.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# O_NONBLOCK: opening a FIFO planted in a root returns at once (and fstat refuses it) instead of
# blocking until a writer appears.
FILE_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def walk_down(fd: int, names: Sequence[str], create: bool, made: Callable[[int, int, bool], None]) -> int:
    """The folder ``names`` below the folder ``fd``, each level opened with ``open_child`` from
    its parent's descriptor (and made if missing and ``create``); ``made(parent_fd, depth,
    missing)`` runs for each level (``depth`` names opened so far) while its parent is still
    open, to make a new name durable. Takes ``fd`` over: it is closed, on failure too; returns
    the last level's descriptor."""
    try:
        for depth, name in enumerate(names, 1):
            child, missing = open_child(fd, name, create)
            try:
                made(fd, depth, missing)
            except BaseException:
                os.close(child)
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def entries(dfd: int) -> list[tuple[str, bool]]:
    """(name, is a folder) of every entry of the folder ``dfd``; a link is never a folder."""
    with os.scandir(dfd) as it:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]


def enter(dfd: int, name: str, fn: Callable[[int], None]) -> bool:
    """Run ``fn`` on the sub-folder ``name`` of ``dfd``, opened ``O_NOFOLLOW`` and closed after;
    False, ``fn`` not run, if it cannot be opened (gone, or replaced by a link: never entered)."""
    try:
        child = os.open(name, DIR_OPEN, dir_fd=dfd)
    except OSError:
        return False
    try:
        fn(child)
    finally:
        os.close(child)
    return True


def write_temp(dir_fd: int, tmp: str, fd: int, write: Callable[[int], object], durable: bool) -> None:
    """``write(fd)`` into the new temp file ``fd``, fsync it if ``durable``, close it; on a
    failure the file is closed and removed."""
    try:
        write(fd)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)


def copy_file(sfd: int, sname: str, dfd: int, tmp: str) -> None:
    """Copy the file ``sname`` of the folder ``sfd`` to a new, fsynced ``tmp`` in ``dfd``
    (removed again on failure): for filesystems without hard links."""
    with open(os.open(sname, FILE_OPEN, dir_fd=sfd), "rb") as fin:

        def copy(fd: int) -> None:
            with open(fd, "wb", closefd=False) as fout:  # flushed when closed, before the fsync
                shutil.copyfileobj(fin, fout, 8 << 20)

        write_temp(dfd, tmp, os.open(tmp, NEW_FILE, 0o644, dir_fd=dfd), copy, durable=True)
