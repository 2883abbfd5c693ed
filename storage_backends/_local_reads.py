"""The local store's reads and listings: files opened by descriptor, never through a link.

Invariants: a missing file, a folder, a link or a non-folder on the way is ``NotFoundError``
(never followed, never blocking: ``FILE_OPEN``, then ``fstat`` refuses anything but a regular
file); a read never allocates more than the size ``fstat`` reported and the caller's ``limit``;
temp files (``.{name}.tmp.*``) are never listed, and listings never enter a link.

``Reads`` is a mixin of ``LocalStore`` (``storage_backends.local``) and uses its helpers.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence

from storage_backends._local_fs import DIR_OPEN, FILE_OPEN, entries, gone, is_temp, preadv_all
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
            return self._pread(fd, key, "get", 0, size)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._open(key) as (fd, size):
            return self._pread(fd, key, "get_range", resolve_range(self.uri, key, start, length, size), length)

    def _pread(self, fd: int, key: str, op: str, pos: int, n: int) -> bytes:
        """``n`` bytes at ``pos``: pread may stop short on huge reads, so it goes on; a file that
        shrank under us is an error, never short data."""
        chunks, got = [], 0
        try:
            while got < n:
                chunk = os.pread(fd, n - got, pos + got)
                if not chunk:
                    raise StorageError(f"{self.uri}: short read of {key!r}: {got} of {n} bytes at {pos}")
                chunks.append(chunk)
                got += len(chunk)
        except OSError as e:
            raise self._err(op, key, e) from None
        return b"".join(chunks)  # one chunk: returned as is, no copy

    def get_range_into(self, key: str, start: int, buffers: Sequence[bytearray | memoryview]) -> None:
        views = as_writable_buffers(buffers)
        length = sum(v.nbytes for v in views)
        with self._open(key) as (fd, size):
            pos = resolve_range(self.uri, key, start, length, size)
            try:
                got = preadv_all(fd, views, pos) if views else 0
            except OSError as e:
                raise self._err("get_range_into", key, e) from None
        if got != length:  # the file shrank under us: never return short data
            raise StorageError(f"{self.uri}: short read of {key!r}: {got} of {length} bytes at {pos}")

    @contextlib.contextmanager
    def _open(self, key: str, op: str = "get_range") -> Iterator[tuple[int, int]]:
        """An open descriptor of the object and its size (a regular file: the module's invariants)."""
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

    def head(self, key: str) -> ObjectInfo:
        try:
            with self._parent(key) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as e:
            raise self._err("head", key, e) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _folder(self, folders: Sequence[str], op: str, what: str) -> int | None:
        """The folder's descriptor, or None where it is missing or a link or a file is on the way
        (a link below the root is not a folder of this store)."""
        try:
            return self._dir_fd(folders)
        except OSError as e:
            if gone(e):
                return None
            raise self._fail(op, repr(what), e) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder, _, name_prefix = check_prefix(prefix).rpartition("/")
        return self._walk(folder.split("/") if folder else [], folder + "/" if folder else "", name_prefix)

    def _walk(self, folders: list[str], key_prefix: str, name_prefix: str) -> Iterator[ObjectInfo]:
        fd = self._folder(folders, "list", key_prefix)
        if fd is not None:
            yield from self._walk_fd(fd, key_prefix, name_prefix)

    def _walk_fd(self, fd: int, key_prefix: str, name_prefix: str = "") -> Iterator[ObjectInfo]:
        """The objects below the folder ``fd``, which this closes once done."""
        # Sorting a folder's entries with "/" appended to sub-folder names yields keys in global
        # lexicographic order lazily: every key below folder "d" starts with "d/", and a file name
        # (which has no "/") compares with all of them as it compares with "d/".
        try:
            try:
                found = [(n, d) for n, d in entries(fd) if not is_temp(n) and n.startswith(name_prefix)]
            except OSError as e:
                raise self._err("list", key_prefix, e) from None
            for name, is_dir in sorted(found, key=lambda t: t[0] + "/" if t[1] else t[0]):
                if is_dir:
                    try:
                        child = os.open(name, DIR_OPEN, dir_fd=fd)
                    except OSError:
                        continue  # removed (or replaced by a link) while we listed
                    yield from self._walk_fd(child, f"{key_prefix}{name}/")
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted while we listed
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key_prefix + name, st.st_size, st.st_mtime)
        finally:
            os.close(fd)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        names, folders = [], []
        fd = self._folder(prefix.rstrip("/").split("/") if prefix else [], "list_dir", prefix)
        if fd is None:
            return [], []
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
