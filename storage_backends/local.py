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
from collections.abc import Callable, Iterator, Sequence

from storage_backends._direct import DIRECT_MIN_BYTES, BouncePool, DirectUnsupported, open_direct, write_direct
from storage_backends.base import (
    Data,
    NotFoundError,
    ObjectInfo,
    StorageError,
    Store,
    as_buffers,
    as_writable_buffers,
    check_dir_prefix,
    check_key,
    check_prefix,
    resolve_range,
)

__all__ = ["LocalStore"]

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


class LocalStore(Store):
    """``/abs/path`` or ``file:///abs/path``. A missing root is an empty store; puts create it.

    Thread- and process-safe: concurrent writers of one key each rename a complete temp file,
    so readers see one whole version; ``put_if_absent`` uses ``link(2)``, which fails if the name
    exists, so exactly one writer wins even across hosts on a POSIX network filesystem.
    """

    def __init__(self, root: str, direct_io: bool | None = None) -> None:
        self.root = os.path.abspath(root)
        self.uri = self.root
        # Folders this store created or saw (and whose creation is durable). A folder may later be
        # removed (delete prunes empty ones, or another process does); writers then get ENOENT on
        # the temp file, forget the folder and create it again, so the cache only saves syscalls.
        self._dirs: set[str] = set()
        self._deferred_dirs: set[str] = set()  # made by put_deferred, durable after the next sync
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
        """For reads: a missing file (or a folder where a file was asked for) is NotFoundError."""
        if isinstance(e, FileNotFoundError | NotADirectoryError | IsADirectoryError):
            return NotFoundError(f"{self.uri}: no object {key!r}")
        return self._fail(op, repr(key), e)

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _ensure_dir(self, path: str, durable: bool = True) -> None:
        """Create ``path`` and its missing parents durably (each new name's parent is fsynced;
        with ``durable=False`` that is left to a later ``sync``)."""
        if path in self._dirs:
            return
        missing = []
        d = path
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    if os.path.lexists(d):
                        raise  # a file is in the way
                    # Made by another thread and already pruned again: the caller retries.
                    raise FileNotFoundError(errno.ENOENT, "folder vanished", d) from None
                # Another thread made it and may not have fsynced the parent yet: do it too, so
                # our put never returns before the folder's name is durable.
            if durable:
                self._fsync_dir(os.path.dirname(d))
            else:
                self._deferred_dirs.add(d)
        if not durable:  # a folder made by a deferred put is not known durable until a sync
            return
        if self._deferred_dirs:
            # Folders a deferred put created above this one: make their names durable now.
            d = path
            while d.startswith(self.root + os.sep):
                if d in self._deferred_dirs:
                    self._fsync_dir(os.path.dirname(d))
                    self._deferred_dirs.discard(d)
                d = os.path.dirname(d)
        self._dirs.add(path)

    def _tmp_path(self, path: str) -> str:
        d, name = os.path.split(path)
        # Truncated so the temp name stays under NAME_MAX (255) for long keys.
        tmp = f".{name[:120]}.tmp.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        return os.path.join(d, tmp)

    def _make_temp(self, path: str, create: Callable[[str], None], durable: bool = True) -> str:
        """A temp file in ``path``'s folder (created durably as needed), filled by ``create``."""
        d = os.path.dirname(path)
        for attempt in range(_DIR_RACE_TRIES):
            try:
                self._ensure_dir(d, durable)
                tmp = self._tmp_path(path)
                create(tmp)
                return tmp
            except FileNotFoundError:
                # A concurrent delete pruned the folder (or a parent we just made) after we
                # looked: make it again.
                if attempt == _DIR_RACE_TRIES - 1:
                    raise
                self._dirs.discard(d)
        raise AssertionError("unreachable")

    def _fill(self, views: list[memoryview], durable: bool = True) -> Callable[[str], None]:
        direct = self._direct and sum(v.nbytes for v in views) >= DIRECT_MIN_BYTES

        def create(tmp: str) -> None:
            if direct and self._direct and self._fill_direct(tmp, views, durable):
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _writev_all(fd, views)
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            os.close(fd)

        return create

    def _fill_direct(self, tmp: str, views: list[memoryview], durable: bool) -> bool:
        """Write ``tmp`` with O_DIRECT; False (nothing left behind) if the filesystem refuses
        it, after which this store writes buffered."""
        try:
            fd = open_direct(tmp)
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
                os.unlink(tmp)
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

    def _prune(self, d: str) -> None:
        """Remove empty folders from ``d`` up to (not including) the root, best-effort."""
        while d != self.root and d.startswith(self.root + os.sep):
            try:
                os.rmdir(d)
            except OSError:
                return
            self._dirs.discard(d)
            d = os.path.dirname(d)

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                return f.readall()
        except OSError as e:
            raise self._err("get", key, e) from None

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
    def _open(self, key: str) -> Iterator[tuple[int, int]]:
        """An open file descriptor of the object and its size."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._err("get_range", key, e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotFoundError(f"{self.uri}: no object {key!r}")
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
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError as e:
            raise self._err("head", key, e) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        folder, _, name_prefix = prefix.rpartition("/")
        start = os.path.join(self.root, *folder.split("/")) if folder else self.root
        return self._walk(start, folder + "/" if folder else "", name_prefix)

    def _walk(self, path: str, key_prefix: str, name_prefix: str = "") -> Iterator[ObjectInfo]:
        # Sorting a folder's entries with "/" appended to sub-folder names yields keys in global
        # lexicographic order lazily: every key below folder "d" starts with "d/", and a file name
        # (which has no "/") compares with all of them as it compares with "d/".
        try:
            with os.scandir(path) as it:
                entries = []
                for e in it:
                    if _is_temp(e.name) or not e.name.startswith(name_prefix):
                        continue
                    is_dir = e.is_dir(follow_symlinks=False)
                    entries.append((e.name + "/" if is_dir else e.name, is_dir, e))
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise self._err("list", key_prefix, e) from None
        entries.sort(key=lambda t: t[0])
        for sort_name, is_dir, e in entries:
            if is_dir:
                yield from self._walk(e.path, key_prefix + sort_name)
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue  # deleted while we listed
            if stat.S_ISREG(st.st_mode):
                yield ObjectInfo(key_prefix + e.name, st.st_size, st.st_mtime)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        path = os.path.join(self.root, *prefix.rstrip("/").split("/")) if prefix else self.root
        names, folders = [], []
        try:
            with os.scandir(path) as it:
                for e in it:
                    if _is_temp(e.name):
                        continue
                    if e.is_dir(follow_symlinks=False):
                        folders.append(e.name)
                    elif e.is_file():
                        names.append(e.name)
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except OSError as e:
            raise self._err("list_dir", prefix, e) from None
        return sorted(names), sorted(folders)

    def exists_root(self) -> bool:
        return os.path.isdir(self.root)

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
        if not os.path.isdir(self.root):
            return
        pending = set(self._deferred_dirs)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _syncfs is None or _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)
        self._deferred_dirs -= pending

    def _put(self, key: str, data: Data, durable: bool) -> None:
        path = self._path(key)
        views = as_buffers(data)
        try:
            tmp = self._make_temp(path, self._fill(views, durable), durable)
            self._replace(tmp, path, durable)
        except OSError as e:
            raise self._fail("put", f"{key!r}", e) from None

    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        views = as_buffers(data)
        try:
            tmp = self._make_temp(path, self._fill(views))
            try:
                # link(2) is the atomic create-if-absent of POSIX: it fails with EEXIST if the name
                # exists, and the new name appears with the complete, fsynced content.
                os.link(tmp, path, follow_symlinks=False)
                won = True
            except FileExistsError:
                won = False
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if won:
                self._fsync_dir(os.path.dirname(path))
        except OSError as e:
            hint = " (the filesystem does not support hard links)" if e.errno in _NO_LINK_ERRNOS else ""
            raise self._fail("put_if_absent", f"{key!r}", e, hint) from None
        return won

    def copy(self, src_key: str, dst_key: str) -> None:
        src, dst = self._path(src_key), self._path(dst_key)

        def create(tmp: str) -> None:
            try:
                # A hard link costs no data copy and is safe because objects are immutable.
                os.link(src, tmp)
            except OSError as e:
                if e.errno not in _NO_LINK_ERRNOS:
                    raise
                self._copy_file(src, tmp)

        if not os.path.isfile(src):
            raise NotFoundError(f"{self.uri}: no object {src_key!r}")
        try:
            tmp = self._make_temp(dst, create)
            self._replace(tmp, dst)
        except OSError as e:
            if not os.path.isfile(src):
                raise NotFoundError(f"{self.uri}: no object {src_key!r}") from None
            raise self._fail("copy", f"{src_key!r} -> {dst_key!r}", e) from None

    @staticmethod
    def _copy_file(src: str, tmp: str) -> None:
        try:
            with open(src, "rb") as fin, open(tmp, "xb") as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _replace(self, tmp: str, path: str, durable: bool = True) -> None:
        """Rename the complete temp file over ``path`` and make the new name durable."""
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # ENOENT: a concurrent delete already removed the object and pruned the folder, which is
        # a valid order of the two calls.
        if durable:
            with contextlib.suppress(FileNotFoundError):
                self._fsync_dir(os.path.dirname(path))

    def delete(self, key: str) -> None:
        path = self._path(key)
        d = os.path.dirname(path)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # no such object (a "folder" is not an object either)
        except OSError as e:
            raise self._fail("delete", f"{key!r}", e) from None
        with contextlib.suppress(FileNotFoundError):
            self._fsync_dir(d)
        self._prune(d)

    def delete_prefix(self, prefix: str) -> int:
        """Every object under ``prefix``, and the temp files of interrupted writes and the
        folders it leaves empty (see ``purge``); returns the files removed."""
        return self.purge(prefix)[0]

    def purge(self, prefix: str) -> tuple[int, int]:
        """Objects first (the listing readers use), then what a killed writer left that no
        listing shows: ``.*.tmp.*`` files and empty folders. Symlinks and other non-regular
        entries are never followed; only temp files (by name) and empty folders are removed
        beyond the listed objects, so anything else left there keeps its folder."""
        check_prefix(prefix)
        n = nbytes = 0
        dirs: set[str] = set()
        for info in list(self.list(prefix)):
            path = os.path.join(self.root, *info.key.split("/"))
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._fail("delete", f"{info.key!r}", e) from None
            n += 1
            nbytes += info.size
            dirs.add(os.path.dirname(path))
        folder, _, name_prefix = prefix.rpartition("/")
        top = os.path.join(self.root, *folder.split("/")) if folder else self.root
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
            with contextlib.suppress(FileNotFoundError):
                self._fsync_dir(d)
            self._prune(d)
        return n, nbytes

    def _purge_leftovers(self, top: str, name_prefix: str) -> tuple[int, int, set[str]]:
        """Remove temp files named for keys under ``top``/``name_prefix`` and the empty folders
        there; returns (files, bytes, folders touched)."""
        n = nbytes = 0
        touched: set[str] = set()

        def unlink_temp(path: str) -> None:
            nonlocal n, nbytes
            try:
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode):
                    return
                os.unlink(path)
            except FileNotFoundError:
                return
            n += 1
            nbytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
            touched.add(os.path.dirname(path))

        try:
            entries = list(os.scandir(top))
        except (FileNotFoundError, NotADirectoryError):
            return 0, 0, touched
        for e in entries:
            if _is_temp(e.name):
                if e.name[1:].startswith(name_prefix):  # ".{name}.tmp..." of a key under the prefix
                    unlink_temp(e.path)
                continue
            if not e.name.startswith(name_prefix) or not e.is_dir(follow_symlinks=False):
                continue
            for d, subdirs, files in os.walk(e.path, topdown=False, followlinks=False):
                for f in files:
                    if _is_temp(f):
                        unlink_temp(os.path.join(d, f))
                for sd in subdirs:  # symlinks to folders show up here too: never followed
                    p = os.path.join(d, sd)
                    with contextlib.suppress(OSError):
                        if stat.S_ISDIR(os.lstat(p).st_mode):
                            os.rmdir(p)  # fails unless empty: then something else lives there
                            self._dirs.discard(p)
                            touched.add(d)
            with contextlib.suppress(OSError):
                os.rmdir(e.path)
                self._dirs.discard(e.path)
                touched.add(top)
        return n, nbytes, touched
