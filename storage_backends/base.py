"""The narrow object-store interface every backend implements.

Keys are ``/``-separated strings relative to the store's root (the job root URI), never starting
with ``/`` and never containing ``..`` components. The verbs are the ones an object store has:
there is no rename, no append and no directory; a "folder" is only a key prefix.

Concurrency contract: every method may be called from many threads at once on one instance.
``put`` is atomic: a concurrent ``get`` sees the old object, the new one or ``NotFoundError``,
never a torn write. ``put`` returns only once the object is durable (fsync on a filesystem, a
200 from S3). ``put_if_absent`` is the only compare-and-set; the commit protocol rests on it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Data",
    "ExistsError",
    "InvalidKeyError",
    "NotFoundError",
    "ObjectInfo",
    "StorageError",
    "Store",
    "as_buffers",
    "as_writable_buffers",
    "check_dir_prefix",
    "check_key",
    "check_limit",
    "check_prefix",
    "data_size",
    "resolve_range",
]

# What ``put`` accepts: one bytes-like object, or a sequence of them that is written as their
# concatenation (scatter-gather), so a shard made of many chunk views and their checksums never
# has to be joined into one buffer in memory first.
Data = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


class StorageError(Exception):
    """An operation on the store failed (after retries, where the backend retries)."""


class NotFoundError(StorageError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else "not found"


class ExistsError(StorageError):
    """A create-only write (``put_new``) found the key taken by another object."""


class InvalidKeyError(StorageError, ValueError):
    """The key is malformed or escapes the store's root."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidKeyError."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"invalid key {key!r}")
    # Every component must be a real name: this rejects "a//b", "a/./b", "../x" and "a/" (a key
    # ending in "/" is a folder on S3 and cannot be a file on a filesystem).
    if any(p in ("", ".", "..") for p in key.split("/")):
        raise InvalidKeyError(f"invalid key {key!r}")
    return key


def check_prefix(prefix: str) -> str:
    """Like check_key but the empty prefix (the whole store) and a trailing ``/`` are allowed."""
    if prefix == "":
        return prefix
    try:
        check_key(prefix[:-1] if isinstance(prefix, str) and prefix.endswith("/") else prefix)
    except InvalidKeyError:
        raise InvalidKeyError(f"invalid prefix {prefix!r}") from None
    return prefix


def check_dir_prefix(prefix: str) -> str:
    """A ``list_dir`` prefix: "" or a valid prefix; a missing trailing ``/`` is added."""
    check_prefix(prefix)
    return prefix if prefix == "" or prefix.endswith("/") else prefix + "/"


def resolve_range(uri: str, key: str, start: int, length: int, size: int) -> int:
    """The absolute start of ``length`` bytes at ``start`` (negative: from the end) in an object
    of ``size`` bytes; StorageError if the range does not lie inside the object."""
    if length < 0:
        raise StorageError(f"{uri}: negative length {length} for {key!r}")
    abs_start = size + start if start < 0 else start
    if abs_start < 0 or abs_start + length > size:
        raise StorageError(f"{uri}: range start={start} length={length} is outside {key!r} ({size} bytes)")
    return abs_start


def check_limit(uri: str, key: str, size: int, limit: int | None) -> None:
    """StorageError if an object of ``size`` bytes exceeds a ``get(key, limit)``."""
    if limit is not None and size > limit:
        raise StorageError(f"{uri}: object {key!r} is {size} bytes, more than the {limit} allowed for it")


def as_buffers(data: Data) -> list[memoryview]:
    """Normalise ``put`` data to a list of flat byte memoryviews."""
    out = []
    for d in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
        mv = memoryview(d)
        if mv.ndim != 1 or mv.format != "B" or not mv.c_contiguous:
            # cast() only works on C-contiguous views; anything else (Fortran order, strided) is
            # copied in logical (C) order, as numpy's tobytes() does.
            mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
        if mv.nbytes:
            out.append(mv)
    return out


def data_size(data: Data) -> int:
    return sum(b.nbytes for b in as_buffers(data))


def as_writable_buffers(buffers: Sequence[bytearray | memoryview]) -> list[memoryview]:
    """Normalise ``get_range_into`` destinations to writable, flat byte memoryviews."""
    views = [memoryview(b) for b in buffers]
    if any(v.readonly for v in views):
        raise ValueError("get_range_into needs writable buffers")
    if not all(v.c_contiguous for v in views):
        raise ValueError("get_range_into needs C-contiguous buffers")
    return as_buffers(views)  # contiguous: cast, never copied


class Store(abc.ABC):
    """An object store rooted at one URI (a job root).

    Implementations: ``LocalStore`` (filesystem), ``MemoryStore`` (in-process), ``S3Store``.
    Use :func:`storage_backends.open_store` to get one from a URI.
    """

    uri: str

    @abc.abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes:
        """The whole object. Raises NotFoundError. ``limit``: an object larger than that many
        bytes raises StorageError before a buffer of its size is allocated (readers of metadata
        pass one, so a huge or endless object cannot exhaust memory)."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start``. A negative ``start`` counts from the end
        (``get_range(k, -16, 16)`` is the last 16 bytes). Raises NotFoundError; a range past the
        end of the object raises StorageError (never returns short data silently)."""

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Several ranges of one object. Backends override this to fetch them in parallel."""
        return [self.get_range(key, s, n) for s, n in ranges]

    def get_range_into(self, key: str, start: int, buffers: Sequence[bytearray | memoryview]) -> None:
        """Fill ``buffers`` (writable, C-contiguous; filled in order) with the bytes at ``start``
        (negative: from the end), as many as they hold together. This is the zero-copy restore
        path: the local backend reads straight into them with ``preadv``. Raises like
        ``get_range``; on an error the buffers' contents are unspecified."""
        views = as_writable_buffers(buffers)
        data = memoryview(self.get_range(key, start, sum(v.nbytes for v in views)))
        pos = 0
        for v in views:
            v[:] = data[pos : pos + v.nbytes]
            pos += v.nbytes

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Write the object atomically and durably, replacing any previous one."""

    def put_deferred(self, key: str, data: Data) -> None:
        """Like ``put`` (atomic), but durable only once a later ``sync`` returns. Backends whose
        puts are durable anyway (S3, memory) just put; the filesystem saves an fsync per file and
        per folder. The commit protocol writes data this way, then syncs, then commits."""
        self.put(key, data)

    def put_new(self, key: str, data: Data) -> object:
        """Create the object only if the key does not exist (a late or concurrent writer can
        never replace it), durable like ``put_deferred`` (once a later ``sync`` returns). Returns
        an identity tag of the object this call created, for ``delete_if``; raises ExistsError
        if the key is taken. Backends override it (a hard link on a filesystem, ``If-None-Match``
        on S3); the default is ``put_if_absent``, whose tag (None) lets nobody delete it."""
        if not self.put_if_absent(key, data):
            raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it")
        return None

    def delete_if(self, key: str, tag: object) -> bool:
        """Delete ``key`` only if it is still the object whose ``put_new`` returned ``tag`` (an
        inode on a filesystem, an ETag on S3), never by key alone: a late cleanup must not remove
        another writer's object that took the key since. True if this call deleted it; False if
        the key holds another object, is gone, or the backend cannot tell (tag None)."""
        return False

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Make every earlier ``put_deferred`` of this store durable."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Data) -> bool:
        """Write the object only if the key does not exist. True if this call wrote it.
        Atomic against concurrent callers on any host: exactly one of them gets True."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; deleting a missing key is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (by ``purge``); returns how many."""
        return self.purge(prefix)[0]

    def purge(self, prefix: str) -> tuple[int, int]:
        """Like ``delete_prefix``, and also remove what a backend keeps beside its objects under
        ``prefix`` (a filesystem's temp files of interrupted writes and empty folders). Returns
        (files, bytes) really removed, counted as they go, for ``ckptd gc`` to report."""
        infos = list(self.list(prefix))
        for info in infos:
            self.delete(info.key)
        return len(infos), sum(info.size for info in infos)

    def abort_stale_uploads(self, older_than: float, prefix: str = "") -> list[str]:
        """Abort the incomplete uploads (S3 multipart uploads) under ``prefix`` of the root (all
        of it by default) that started more than ``older_than`` seconds ago; returns their keys.
        Their parts are stored and billed but no listing shows them. Backends without such
        uploads have none."""
        return []

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a plain string prefix, recursive),
        in lexicographic key order."""

    @abc.abstractmethod
    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """One level below ``prefix`` (which is "" or ends with "/"; a missing "/" is added):
        (object names, child "folder" names), both sorted and relative to ``prefix``, folders
        without a trailing slash. This is how checkpoints are found without listing every
        chunk."""

    def list_dir_after(self, prefix: str, after: str) -> tuple[list[str], list[str]]:
        """``list_dir(prefix)`` without the entries that sort at or before ``after`` (a name
        relative to ``prefix``). S3 asks for the later ones alone (``StartAfter``): one request
        when few follow, however many come before. Other stores filter a whole listing."""
        names, folders = self.list_dir(prefix)
        return [n for n in names if n > after], [f for f in folders if f > after]

    def head(self, key: str) -> ObjectInfo:
        """Size and mtime of one object. Raises NotFoundError."""
        check_key(key)
        for info in self.list(key):
            if info.key == key:
                return info
        raise NotFoundError(f"{self.uri}: no object {key!r}")

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except NotFoundError:
            return False
        return True

    def copy(self, src_key: str, dst_key: str) -> None:
        """Copy an object inside this store. Backends override it with a server-side copy or a
        hard link; the default reads and writes."""
        self.put(dst_key, self.get(src_key))

    def exists_root(self) -> bool:
        """Whether the root itself exists (a folder, a bucket). A missing root is an empty store
        for reads; the first put creates it."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and thread pools."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
