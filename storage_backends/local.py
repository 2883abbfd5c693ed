"""A store on a local or network filesystem: one file per key under a root folder.

Durability and atomicity follow the usual recipe: every write goes to a temp file in the target's
own folder (``.{name}.tmp.{pid}.{thread}.{random}``), is fsynced, then renamed (``put``) or
hard-linked (``put_if_absent``) into place, and the folder is fsynced so the new name survives
a crash. Temp files are never listed; a crash may leave one behind, which is harmless.

Objects are never modified in place (a ``put`` replaces the inode), which is what makes
``copy`` by hard link safe.

Objects of 1 MiB or more are written with ``O_DIRECT`` (``storage_backends._direct``): past the
page cache, which a checkpoint written once and read elsewhere only pollutes, and whose
reclaim and writeback made buffered saves swing 2x run to run here. ``CKPTD_DIRECT_IO=0`` turns
it off; a filesystem that refuses ``O_DIRECT`` gets buffered writes. Durability is the same in
both cases (the fsync, or the ``syncfs`` of ``sync``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from storage_backends._direct import DIRECT_MIN_BYTES, BouncePool, DirectUnsupported, open_direct, write_direct
from storage_backends.base import (
    Data,
    ExistsError,
    NotFoundError,
    ObjectInfo,
    StorageError,
    Store,
    as_buffers,
    as_writable_buffers,
    check_dir_prefix,
    check_key,
    check_limit,
    check_prefix,
    resolve_range,
)

__all__ = ["LinkRefused", "LocalStore"]

try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024
if _IOV_MAX <= 0:
    _IOV_MAX = 1024

log = logging.getLogger("ckptd")

# os.link failures that mean "this filesystem has no hard links", not "the key exists".
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}

# How often a write retries when concurrent deletes keep pruning the folder it writes into.
_DIR_RACE_TRIES = 20


def _load_syncfs():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):  # not Linux/glibc: fall back to sync(2)
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_syncfs = _load_syncfs()


def _is_temp(name: str) -> bool:
    return name.startswith(".") and ".tmp." in name


def _advance(views: list[memoryview], i: int, off: int, n: int) -> tuple[int, int]:
    """Move the (buffer index, offset) cursor ``n`` bytes forward."""
    while n:
        rest = views[i].nbytes - off
        if n < rest:
            return i, off + n
        n -= rest
        i, off = i + 1, 0
    return i, off


def _batch(views: list[memoryview], i: int, off: int) -> list[memoryview]:
    return [views[i][off:], *views[i + 1 : i + _IOV_MAX]]


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """Write every view, IOV_MAX at a time, resuming after partial writes."""
    i = off = 0
    while i < len(views):
        n = os.writev(fd, _batch(views, i, off))
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        i, off = _advance(views, i, off, n)


def _preadv_all(fd: int, views: list[memoryview], pos: int) -> int:
    """Fill every view from ``pos``, resuming after partial reads; returns the bytes read (less
    than asked only at end of file)."""
    i = off = total = 0
    while i < len(views):
        n = os.preadv(fd, _batch(views, i, off), pos + total)
        if n == 0:
            break
        total += n
        i, off = _advance(views, i, off, n)
    return total


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class LinkRefused(StorageError):
    """A write met a symbolic link (or a non-folder) below the store's root: refused, never followed."""


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_child(fd: int, name: str, create: bool) -> tuple[int, bool]:
    """The folder ``name`` in the folder ``fd``, opened ``O_NOFOLLOW``; if missing and
    ``create``, made first. Returns (its descriptor, whether it was missing): the caller makes a
    missing one's name durable (fsync of ``fd``), also when another thread made it meanwhile (it
    may not have fsynced the parent yet, and our put must not return before the name is durable).
    Raises OSError: ENOENT when missing and not ``create``, ELOOP/ENOTDIR for a link or a file."""
    try:
        return os.open(name, _DIR_OPEN, dir_fd=fd), False
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=fd)
    return os.open(name, _DIR_OPEN, dir_fd=fd), True


# O_NONBLOCK: opening a FIFO planted in a root returns at once (and fstat refuses it) instead of
# blocking until a writer appears.
_FILE_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LocalStore(Store):
    """``/abs/path`` or ``file:///abs/path``. A missing root is an empty store; puts create it.

    Thread- and process-safe: concurrent writers of one key each rename a complete temp file,
    so readers see one whole version; ``put_if_absent`` uses ``link(2)``, which fails if the name
    exists, so exactly one writer wins even across hosts on a POSIX network filesystem.

    Nothing below the root is followed through a symbolic link (the root itself may be one):
    every folder is opened from its parent's descriptor with ``O_NOFOLLOW`` and every file with
    ``O_NOFOLLOW | O_NONBLOCK``, then checked with ``fstat``. So a step folder that is a link to
    elsewhere, planted in a root someone else can write, reads as absent, is never written through
    (``LinkRefused``) and is never deleted through; a FIFO or a device file is not an object.
    """

    def __init__(self, root: str, direct_io: bool | None = None, *, below: str | None = None) -> None:
        """``below``: a folder the root lies inside (a daemon's served root, the root a request
        named below it). Then only ``below`` itself may be a link: every folder from it down to the
        root is opened (or made) one level at a time with ``O_NOFOLLOW``, so a link planted on the
        way (``served/link/theirjob``) is never followed, for reads, writes and deletes alike."""
        self.root = os.path.abspath(root)
        self.uri = self.root
        self._below: str | None = None
        self._below_parts: tuple[str, ...] = ()
        if below is not None:
            base = os.path.abspath(below)
            rel = os.path.relpath(self.root, base)
            if rel == os.curdir:
                rel = ""
            if rel == os.pardir or rel.startswith(os.pardir + os.sep):
                raise StorageError(f"{self.root} is not inside {base}")
            self._below = base
            self._below_parts = tuple(p for p in rel.split(os.sep) if p)
        # Folders made by put_deferred, durable after the next sync (or the next durable put below
        # them, which fsyncs their parents first).
        self._deferred_dirs: set[str] = set()
        self._dirs_lock = threading.Lock()
        # Objects of DIRECT_MIN_BYTES or more are written with O_DIRECT (``_direct``), unless
        # CKPTD_DIRECT_IO=0 or the filesystem refuses it.
        self._direct = direct_io if direct_io is not None else os.environ.get("CKPTD_DIRECT_IO", "1") != "0"
        self._bounce = BouncePool()

    # -- helpers ----------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _fail(self, op: str, what: str, e: OSError, hint: str = "") -> StorageError:
        return StorageError(f"{self.uri}: {op} {what} failed: {e.strerror or e} (errno {e.errno}){hint}")

    def _err(self, op: str, key: str, e: OSError) -> StorageError:
        """For reads: a missing file (or a folder, a link, a non-folder on the way) is NotFoundError."""
        if isinstance(e, FileNotFoundError | NotADirectoryError | IsADirectoryError) or e.errno == errno.ELOOP:
            return NotFoundError(f"{self.uri}: no object {key!r}")
        return self._fail(op, repr(key), e)

    def _dir_fd(self, parts: Sequence[str], create: bool = False, durable: bool = True) -> int:
        """A descriptor of the folder ``root/parts...``, each level opened ``O_NOFOLLOW`` from its
        parent's descriptor. ``create``: missing levels are made (with the root), their names made
        durable (fsync of the parent) unless ``durable=False``, which leaves that to ``sync``.
        Raises OSError: ENOENT for a missing level, ELOOP/ENOTDIR for a link or a file."""
        fd = self._root_fd(create)
        path = self.root
        try:
            for name in parts:
                path = f"{path}/{name}"
                child, missing = _open_child(fd, name, create)
                if missing:
                    if durable:
                        os.fsync(fd)
                    else:
                        with self._dirs_lock:
                            self._deferred_dirs.add(path)
                else:
                    if durable and self._deferred_dirs and path in self._deferred_dirs:
                        os.fsync(fd)  # a deferred put made it: make its name durable now
                        with self._dirs_lock:
                            self._deferred_dirs.discard(path)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _root_fd(self, create: bool = False) -> int:
        """A descriptor of the root folder. The root itself may be a link, unless the store was
        made with ``below``: then only that folder may be, and each level under it is opened (or
        made, durably) with ``O_NOFOLLOW``; a link there raises OSError ELOOP or ENOTDIR."""
        top = self.root if self._below is None else self._below
        try:
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(top, exist_ok=True)
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in self._below_parts:
                child, missing = _open_child(fd, name, create)
                if missing:
                    os.fsync(fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _root_exists(self) -> bool:
        try:
            os.close(self._root_fd())
        except OSError:
            return False
        return True

    @contextlib.contextmanager
    def _parent(self, key: str, create: bool = False, durable: bool = True) -> Iterator[tuple[int, str]]:
        """(descriptor of the key's folder, the key's file name), closed on exit."""
        *folders, name = check_key(key).split("/")
        fd = self._dir_fd(folders, create, durable)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _write_error(self, op: str, key: str, e: OSError, hint: str = "") -> StorageError:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return LinkRefused(
                f"{self.uri}: {op} {key!r} refused: a symbolic link or a file is in the way below the root "
                "(links are never followed)"
            )
        return self._fail(op, repr(key), e, hint)

    @staticmethod
    def _tmp_name(name: str) -> str:
        # Truncated so the temp name stays under NAME_MAX (255) for long keys.
        return f".{name[:120]}.tmp.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"

    def _make_temp(self, key: str, create: Callable[[int, str], None], durable: bool = True) -> tuple[int, str, str]:
        """(folder descriptor, temp name, key's name): a temp file in the key's folder (made
        durably as needed), filled by ``create(dir_fd, temp_name)``. The caller closes the fd."""
        for attempt in range(_DIR_RACE_TRIES):
            with contextlib.ExitStack() as stack:
                *folders, name = check_key(key).split("/")
                try:
                    fd = self._dir_fd(folders, True, durable)
                    stack.callback(os.close, fd)
                    tmp = self._tmp_name(name)
                    create(fd, tmp)
                except FileNotFoundError:
                    # A concurrent delete pruned the folder after we opened it (no file can be
                    # made in a removed folder): make it again.
                    if attempt == _DIR_RACE_TRIES - 1:
                        raise
                    continue
                stack.pop_all()
                return fd, tmp, name
        raise AssertionError("unreachable")

    def _fill(self, views: list[memoryview], durable: bool = True) -> Callable[[int, str], None]:
        direct = self._direct and sum(v.nbytes for v in views) >= DIRECT_MIN_BYTES

        def create(dir_fd: int, tmp: str) -> None:
            if direct and self._direct and self._fill_direct(dir_fd, tmp, views, durable):
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
            try:
                _writev_all(fd, views)
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.close(fd)

        return create

    def _fill_direct(self, dir_fd: int, tmp: str, views: list[memoryview], durable: bool) -> bool:
        """Write ``tmp`` with O_DIRECT; False (nothing left behind) if the filesystem refuses
        it, after which this store writes buffered."""
        try:
            fd = open_direct(tmp, dir_fd=dir_fd)
        except DirectUnsupported as e:
            self._no_direct(e)
            return False
        try:
            write_direct(fd, views, self._bounce)
            if durable:
                os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            if isinstance(e, DirectUnsupported):
                self._no_direct(e)
                return False
            raise
        os.close(fd)
        return True

    def _no_direct(self, e: OSError) -> None:
        if self._direct:
            self._direct = False
            log.info("%s: writing through the page cache (%s)", self.root, e)

    def _prune(self, folders: Sequence[str]) -> None:
        """Remove empty folders from ``root/folders`` up to (not including) the root, best-effort,
        each by name from its parent's descriptor."""
        folders = list(folders)
        while folders:
            try:
                fd = self._dir_fd(folders[:-1])
            except OSError:
                return
            try:
                os.rmdir(folders[-1], dir_fd=fd)
            except OSError:
                return
            finally:
                os.close(fd)
            folders.pop()

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        with self._open(key, "get") as (fd, size):
            check_limit(self.uri, key, size, limit)
            try:
                data = os.pread(fd, size, 0) if size else b""
                if 0 < len(data) < size:
                    data = b"".join([data, *self._pread_rest(fd, len(data), size - len(data))])
            except OSError as e:
                raise self._err("get", key, e) from None
        if len(data) != size:
            raise StorageError(f"{self.uri}: short read of {key!r}: {len(data)} of {size} bytes")
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._open(key) as (fd, size):
            pos = resolve_range(self.uri, key, start, length, size)
            try:
                data = os.pread(fd, length, pos) if length else b""
                if 0 < len(data) < length:  # pread may stop short on huge reads: go on
                    data = b"".join([data, *self._pread_rest(fd, pos + len(data), length - len(data))])
            except OSError as e:
                raise self._err("get_range", key, e) from None
        if len(data) != length:  # the file shrank under us: never return short data
            raise StorageError(f"{self.uri}: short read of {key!r}: {len(data)} of {length} bytes at {pos}")
        return data

    @staticmethod
    def _pread_rest(fd: int, pos: int, n: int) -> Iterator[bytes]:
        while n > 0:
            chunk = os.pread(fd, n, pos)
            if not chunk:
                return
            yield chunk
            pos, n = pos + len(chunk), n - len(chunk)

    def get_range_into(self, key: str, start: int, buffers: Sequence[bytearray | memoryview]) -> None:
        views = as_writable_buffers(buffers)
        self._read_into(key, start, sum(v.nbytes for v in views), views)

    @contextlib.contextmanager
    def _open(self, key: str, op: str = "get_range") -> Iterator[tuple[int, int]]:
        """An open file descriptor of the object and its size: a regular file reached without a
        link (a FIFO, a device, a link to ``/dev/zero`` is no object)."""
        try:
            with self._parent(key) as (dfd, name):
                fd = os.open(name, _FILE_OPEN, dir_fd=dfd)
        except OSError as e:
            raise self._err(op, key, e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotFoundError(f"{self.uri}: no object {key!r} (not a regular file)")
            yield fd, st.st_size
        finally:
            os.close(fd)

    def _read_into(self, key: str, start: int, length: int, views: list[memoryview]) -> None:
        with self._open(key) as (fd, size):
            pos = resolve_range(self.uri, key, start, length, size)
            try:
                got = _preadv_all(fd, views, pos) if views else 0
            except OSError as e:
                raise self._err("get_range_into", key, e) from None
        if got != length:  # the file shrank under us: never return short data
            raise StorageError(f"{self.uri}: short read of {key!r}: {got} of {length} bytes at {pos}")

    def head(self, key: str) -> ObjectInfo:
        try:
            with self._parent(key) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as e:
            raise self._err("head", key, e) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        folder, _, name_prefix = prefix.rpartition("/")
        return self._walk(folder.split("/") if folder else [], folder + "/" if folder else "", name_prefix)

    def _walk(self, folders: list[str], key_prefix: str, name_prefix: str = "") -> Iterator[ObjectInfo]:
        try:
            fd = self._dir_fd(folders)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno == errno.ELOOP:
                return  # a link below the root is not a folder of this store
            raise self._err("list", key_prefix, e) from None
        try:
            yield from self._walk_fd(fd, key_prefix, name_prefix)
        finally:
            os.close(fd)

    def _walk_fd(self, fd: int, key_prefix: str, name_prefix: str = "") -> Iterator[ObjectInfo]:
        # Sorting a folder's entries with "/" appended to sub-folder names yields keys in global
        # lexicographic order lazily: every key below folder "d" starts with "d/", and a file name
        # (which has no "/") compares with all of them as it compares with "d/".
        try:
            with os.scandir(fd) as it:
                entries = []
                for e in it:
                    if _is_temp(e.name) or not e.name.startswith(name_prefix):
                        continue
                    is_dir = e.is_dir(follow_symlinks=False)
                    entries.append((e.name + "/" if is_dir else e.name, is_dir, e))
        except OSError as e:
            raise self._err("list", key_prefix, e) from None
        entries.sort(key=lambda t: t[0])
        for sort_name, is_dir, e in entries:
            if is_dir:
                try:
                    child = os.open(e.name, _DIR_OPEN, dir_fd=fd)
                except OSError:
                    continue  # removed (or replaced by a link) while we listed
                try:
                    yield from self._walk_fd(child, key_prefix + sort_name)
                finally:
                    os.close(child)
                continue
            try:
                st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while we listed
            if stat.S_ISREG(st.st_mode):
                yield ObjectInfo(key_prefix + e.name, st.st_size, st.st_mtime)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        names, folders = [], []
        try:
            fd = self._dir_fd(prefix.rstrip("/").split("/") if prefix else [])
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except OSError as e:
            if e.errno == errno.ELOOP:
                return [], []
            raise self._err("list_dir", prefix, e) from None
        try:
            with os.scandir(fd) as it:
                for e in it:
                    if _is_temp(e.name):
                        continue
                    if e.is_dir(follow_symlinks=False):
                        folders.append(e.name)
                    elif e.is_file(follow_symlinks=False):
                        names.append(e.name)
        except OSError as e:
            raise self._err("list_dir", prefix, e) from None
        finally:
            os.close(fd)
        return sorted(names), sorted(folders)

    def exists_root(self) -> bool:
        return self._root_exists()

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: str, data: Data) -> None:
        self._put(key, data, durable=True)

    def put_deferred(self, key: str, data: Data) -> None:
        """Atomic like ``put`` but not fsynced: durable only once ``sync`` returns. Many small
        fsyncs (each file, each folder) cost far more than one ``syncfs`` of the filesystem."""
        self._put(key, data, durable=False)

    def sync(self) -> None:
        """Make every earlier ``put_deferred`` durable: ``syncfs(2)`` on the root's filesystem
        (all dirty data and metadata of that filesystem), falling back to ``sync(2)``."""
        try:
            fd = self._root_fd()
        except OSError:
            return
        with self._dirs_lock:
            pending = set(self._deferred_dirs)
        try:
            if _syncfs is None or _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)
        with self._dirs_lock:
            self._deferred_dirs -= pending

    def _put(self, key: str, data: Data, durable: bool) -> None:
        views = as_buffers(data)
        try:
            fd, tmp, name = self._make_temp(key, self._fill(views, durable), durable)
            try:
                self._replace(fd, tmp, name, durable)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._write_error("put", key, e) from None

    def put_if_absent(self, key: str, data: Data) -> bool:
        views = as_buffers(data)
        try:
            fd, tmp, name = self._make_temp(key, self._fill(views))
            try:
                try:
                    # link(2) is the atomic create-if-absent of POSIX: it fails with EEXIST if the
                    # name exists (a link too), and the new name appears with the complete,
                    # fsynced content.
                    os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                    won = True
                except FileExistsError:
                    won = False
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=fd)
                if won:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            hint = " (the filesystem does not support hard links)" if e.errno in _NO_LINK_ERRNOS else ""
            raise self._write_error("put_if_absent", key, e, hint) from None
        return won

    def put_new(self, key: str, data: Data) -> tuple[int, int, int, int]:
        """Create-only, durable at the next ``sync``: the temp file is hard-linked to the key's
        name (``link(2)`` fails with EEXIST: ExistsError, nothing replaced), never renamed over
        it, then unlinked. Returns the file's (st_dev, st_ino, st_mtime_ns, st_size), its identity
        for ``delete_if`` (the inode number alone may be reused by a file made after ours)."""
        views = as_buffers(data)
        try:
            fd, tmp, name = self._make_temp(key, self._fill(views, durable=False), durable=False)
            try:
                try:
                    st = os.stat(tmp, dir_fd=fd, follow_symlinks=False)
                    os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it") from None
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=fd)
            finally:
                os.close(fd)
        except OSError as e:
            hint = " (the filesystem does not support hard links)" if e.errno in _NO_LINK_ERRNOS else ""
            raise self._write_error("put_new", key, e, hint) from None
        return _identity(st)

    def delete_if(self, key: str, tag: object) -> bool:
        """Rename the name aside to a temp name of our own, check the file's identity there,
        unlink it if it is ``tag``, else link it back (create-only) and drop the aside name: no
        other writer's file is ever removed, even one that took the key a moment ago. (An aside
        name a crash leaves behind is a temp file: ``purge`` removes it.)"""
        if not isinstance(tag, tuple) or len(tag) != 4:
            return False
        try:
            with self._parent(key) as (dfd, name):
                aside = self._tmp_name(name)
                try:
                    os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    return False
                st = os.stat(aside, dir_fd=dfd, follow_symlinks=False)
                ours = _identity(st) == tag and stat.S_ISREG(st.st_mode)
                if not ours:
                    try:
                        os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                    except FileExistsError:
                        log.warning("%s: %r was taken again while checking it; left %r aside", self.uri, key, aside)
                        return False
                os.unlink(aside, dir_fd=dfd)
                os.fsync(dfd)
        except OSError as e:
            if e.errno == errno.ELOOP or isinstance(e, FileNotFoundError | NotADirectoryError):
                return False
            raise self._fail("delete_if", f"{key!r}", e) from None
        if ours:
            self._prune(check_key(key).split("/")[:-1])
        return ours

    def copy(self, src_key: str, dst_key: str) -> None:
        try:
            with self._parent(src_key) as (sfd, sname):
                st = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError(errno.ENOENT, "not a regular file")

                def create(dfd: int, tmp: str) -> None:
                    try:
                        # A hard link costs no data copy and is safe because objects are immutable.
                        os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                    except OSError as e:
                        if e.errno not in _NO_LINK_ERRNOS:
                            raise
                        self._copy_file(sfd, sname, dfd, tmp)

                fd, tmp, name = self._make_temp(dst_key, create)
                try:
                    self._replace(fd, tmp, name)
                finally:
                    os.close(fd)
        except (FileNotFoundError, NotADirectoryError) as e:
            if e.filename is None and not self.exists(src_key):
                raise NotFoundError(f"{self.uri}: no object {src_key!r}") from None
            if not self.exists(src_key):
                raise NotFoundError(f"{self.uri}: no object {src_key!r}") from None
            raise self._write_error("copy", f"{src_key} -> {dst_key}", e) from None
        except OSError as e:
            if e.errno == errno.ELOOP and not self.exists(src_key):
                raise NotFoundError(f"{self.uri}: no object {src_key!r}") from None
            raise self._write_error("copy", f"{src_key} -> {dst_key}", e) from None

    @staticmethod
    def _copy_file(sfd: int, sname: str, dfd: int, tmp: str) -> None:
        src = os.open(sname, _FILE_OPEN, dir_fd=sfd)
        try:
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        except BaseException:
            os.close(src)
            raise
        try:
            with open(src, "rb", closefd=False) as fin, open(dst, "wb", closefd=False) as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)
                fout.flush()
                os.fsync(dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        finally:
            os.close(src)
            os.close(dst)

    def _replace(self, dir_fd: int, tmp: str, name: str, durable: bool = True) -> None:
        """Rename the complete temp file over ``name`` and make the new name durable."""
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)

    def delete(self, key: str) -> None:
        *folders, _ = check_key(key).split("/")
        try:
            with self._parent(key) as (dfd, name):
                os.unlink(name, dir_fd=dfd)  # a link is removed itself, never followed
                os.fsync(dfd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # no such object (a "folder" is not an object either)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return  # a link on the way: nothing of this store is there
            raise self._fail("delete", f"{key!r}", e) from None
        self._prune(folders)

    def delete_prefix(self, prefix: str) -> int:
        """Every object under ``prefix``, and the temp files of interrupted writes and the
        folders it leaves empty (see ``purge``); returns the files removed."""
        return self.purge(prefix)[0]

    def purge(self, prefix: str) -> tuple[int, int]:
        """Objects first (the listing readers use), then what a killed writer left that no
        listing shows: ``.*.tmp.*`` files and empty folders. Returns (files, bytes) removed.
        Every name is removed from its parent's descriptor and no link is followed (a link is
        neither an object nor a folder of this store); only temp files (by name) and empty
        folders are removed beyond the listed objects, so anything else left there keeps its
        folder."""
        check_prefix(prefix)
        n = nbytes = 0
        dirs: set[tuple[str, ...]] = set()
        for info in list(self.list(prefix)):
            *folders, _ = info.key.split("/")
            try:
                with self._parent(info.key) as (dfd, name):
                    os.unlink(name, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                if e.errno == errno.ELOOP:
                    continue
                raise self._fail("delete", f"{info.key!r}", e) from None
            n += 1
            nbytes += info.size
            dirs.add(tuple(folders))
        folder, _, name_prefix = prefix.rpartition("/")
        top = tuple(folder.split("/")) if folder else ()
        try:
            m, mbytes, emptied = self._purge_leftovers(top, name_prefix)
        except OSError as e:
            raise self._fail("delete", f"{prefix!r}", e) from None
        n, nbytes = n + m, nbytes + mbytes
        dirs |= emptied
        if folder and not name_prefix:
            dirs.add(top)  # the prefix names a folder: remove it too once empty
        # One fsync per folder instead of one per file; deepest folders first so pruning works.
        for d in sorted(dirs, key=len, reverse=True):
            with contextlib.suppress(OSError):
                fd = self._dir_fd(d)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._prune(d)
        return n, nbytes

    def abort_stale_uploads(self, older_than: float, prefix: str = "") -> list[str]:
        """A filesystem's incomplete uploads are the temp files of writes that never finished
        (their writer was killed between writing and renaming, or between the link and the
        unlink of ``put_if_absent``): remove those last modified more than ``older_than``
        seconds ago, anywhere under the folder ``prefix`` of the root (all of it by default), even
        inside committed steps, which ``purge`` never touches. Returns their paths. Walks by
        descriptors; links are never entered."""
        check_dir_prefix(prefix)
        top = tuple(p for p in prefix.split("/") if p)
        cutoff = time.time() - older_than
        removed: list[str] = []

        def walk(dfd: int, where: tuple[str, ...]) -> None:
            with os.scandir(dfd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in entries:
                if is_dir:
                    try:
                        child = os.open(name, _DIR_OPEN, dir_fd=dfd)
                    except OSError:
                        continue
                    try:
                        walk(child, (*where, name))
                    finally:
                        os.close(child)
                elif _is_temp(name):
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if st.st_mtime <= cutoff:
                            os.unlink(name, dir_fd=dfd)
                            removed.append("/".join((*where, name)))

        try:
            fd = self._dir_fd(top)
        except OSError as e:
            if isinstance(e, FileNotFoundError | NotADirectoryError):
                return removed
            raise self._fail("list", repr(prefix), e) from None
        try:
            walk(fd, top)
        except OSError as e:
            raise self._fail("delete", "temp files", e) from None
        finally:
            os.close(fd)
        return sorted(removed)

    def _purge_leftovers(self, top: tuple[str, ...], name_prefix: str) -> tuple[int, int, set[tuple[str, ...]]]:
        """Remove temp files named for keys under ``top``/``name_prefix`` and the empty folders
        there, walking by descriptors; returns (files, bytes, folders touched)."""
        counts = [0, 0]
        touched: set[tuple[str, ...]] = set()

        def unlink_temp(dfd: int, name: str, where: tuple[str, ...]) -> None:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            counts[0] += 1
            counts[1] += st.st_size if stat.S_ISREG(st.st_mode) else 0
            touched.add(where)

        def tree(dfd: int, where: tuple[str, ...]) -> None:
            """Temp files and empty sub-folders of the folder ``dfd`` (links never entered)."""
            with os.scandir(dfd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in entries:
                if not is_dir:
                    if _is_temp(name):
                        unlink_temp(dfd, name, where)
                    continue
                try:
                    child = os.open(name, _DIR_OPEN, dir_fd=dfd)
                except OSError:
                    continue  # gone, or replaced by a link: not ours to enter
                try:
                    tree(child, (*where, name))
                finally:
                    os.close(child)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=dfd)  # fails unless empty: then something else lives there
                    touched.add(where)

        try:
            fd = self._dir_fd(top)
        except OSError as e:
            if isinstance(e, FileNotFoundError | NotADirectoryError) or e.errno == errno.ELOOP:
                return 0, 0, touched
            raise
        try:
            with os.scandir(fd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in entries:
                if _is_temp(name):
                    if name[1:].startswith(name_prefix):  # ".{name}.tmp..." of a key under the prefix
                        unlink_temp(fd, name, top)
                    continue
                if not name.startswith(name_prefix) or not is_dir:
                    continue
                try:
                    child = os.open(name, _DIR_OPEN, dir_fd=fd)
                except OSError:
                    continue
                try:
                    tree(child, (*top, name))
                finally:
                    os.close(child)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=fd)
                    touched.add(top)
        finally:
            os.close(fd)
        return counts[0], counts[1], touched
