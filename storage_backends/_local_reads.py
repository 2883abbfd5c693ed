"""The local store's reads and listings: files opened by descriptor, never through a link.

Invariants: a missing file, a folder, a link or a non-folder on the way is ``NotFoundError``
(never followed, never blocking: ``FILE_OPEN``, then ``fstat`` refuses anything but a regular
file); a read never allocates more than the size ``fstat`` reported and the caller's ``limit``;
temp files (``.{name}.tmp.*``) are never listed, and listings never enter a link.

``Reads`` is a mixin of ``LocalStore`` (``storage_backends.local``): it uses the store's
``_parent``, ``_dir_fd``, ``_err``, ``_fail``, ``_root_exists`` and ``uri``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence

from storage_backends._local_fs import DIR_OPEN, FILE_OPEN, is_temp, preadv_all
from storage_backends.base import (
    NotFoundError,
    ObjectInfo,
    StorageError,
    as_writable_buffers,
    check_dir_prefix,
    check_limit,
    check_prefix,
    resolve_range,
)

__all__ = ["Reads"]


class Reads:
    """get, get_range, get_range_into, head, list and list_dir of ``LocalStore``."""

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
                fd = os.open(name, FILE_OPEN, dir_fd=dfd)
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
                got = preadv_all(fd, views, pos) if views else 0
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
                    if is_temp(e.name) or not e.name.startswith(name_prefix):
                        continue
                    is_dir = e.is_dir(follow_symlinks=False)
                    entries.append((e.name + "/" if is_dir else e.name, is_dir, e))
        except OSError as e:
            raise self._err("list", key_prefix, e) from None
        entries.sort(key=lambda t: t[0])
        for sort_name, is_dir, e in entries:
            if is_dir:
                try:
                    child = os.open(e.name, DIR_OPEN, dir_fd=fd)
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
                    if is_temp(e.name):
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
