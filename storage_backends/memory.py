"""An in-process store for tests: a dict of immutable ``bytes`` behind one lock.

Stores opened with the same name (``open_store("memory://x")`` twice, from any thread) share one
process-global namespace, so a test can write through one store and read through another as two
hosts would. Nothing is ever persisted; ``reset`` drops namespaces.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from storage_backends.base import (
    Data,
    ExistsError,
    NotFoundError,
    ObjectInfo,
    Store,
    as_buffers,
    check_dir_prefix,
    check_key,
    check_limit,
    check_prefix,
    resolve_range,
)

__all__ = ["MemoryStore", "reset"]


@dataclass(eq=False)
class _Namespace:
    """The shared state behind every MemoryStore of one name (compared by identity)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, tuple[bytes, float]] = field(default_factory=dict)


_namespaces: dict[str, _Namespace] = {}
_namespaces_lock = threading.Lock()
_anonymous = itertools.count()


def reset(name: str | None = None) -> None:
    """Forget the namespace ``name`` (every one when None). Open stores keep what they hold."""
    with _namespaces_lock:
        if name is None:
            _namespaces.clear()
        else:
            _namespaces.pop(name, None)


class MemoryStore(Store):
    """``memory://name``. ``MemoryStore()`` without a name gets a private namespace.

    Thread-safe: every method takes the namespace's lock for the dict operation only; objects
    are immutable ``bytes`` copied on ``put``, so readers never see a torn or later-mutated
    buffer.
    """

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            name = f"anonymous-{next(_anonymous)}"
            self._ns = _Namespace()
        else:
            with _namespaces_lock:
                self._ns = _namespaces.setdefault(name, _Namespace())
        self.name = name
        self.uri = f"memory://{name}"

    def _entry(self, key: str) -> tuple[bytes, float]:
        check_key(key)
        with self._ns.lock:
            entry = self._ns.objects.get(key)
        if entry is None:
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return entry

    def get(self, key: str, limit: int | None = None) -> bytes:
        data = self._entry(key)[0]
        check_limit(self.uri, key, len(data), limit)
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self._entry(key)[0]
        start = resolve_range(self.uri, key, start, length, len(data))
        return data[start : start + length]

    def put(self, key: str, data: Data) -> None:
        self._set(check_key(key), b"".join(as_buffers(data)))  # a fresh copy: callers may reuse their buffers

    def _set(self, key: str, blob: bytes) -> None:
        with self._ns.lock:
            self._ns.objects[key] = (blob, time.time())

    def put_if_absent(self, key: str, data: Data) -> bool:
        try:
            self.put_new(key, data)
        except ExistsError:
            return False
        return True

    def put_new(self, key: str, data: Data) -> object:
        """Check-and-set under the lock; the tag is the entry itself (compared by identity)."""
        check_key(key)
        entry = (b"".join(as_buffers(data)), time.time())
        with self._ns.lock:
            if key in self._ns.objects:
                raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it")
            self._ns.objects[key] = entry
        return entry

    def delete(self, key: str) -> None:
        check_key(key)
        with self._ns.lock:
            self._ns.objects.pop(key, None)

    def delete_if(self, key: str, tag: object) -> bool:
        check_key(key)
        with self._ns.lock:
            if tag is None or self._ns.objects.get(key) is not tag:
                return False
            del self._ns.objects[key]
        return True

    def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        with self._ns.lock:
            doomed = [k for k in self._ns.objects if k.startswith(prefix)]
            for k in doomed:
                del self._ns.objects[k]
        return len(doomed)

    def _snapshot(self, prefix: str) -> list[tuple[str, bytes, float]]:
        with self._ns.lock:
            items = [(k, v[0], v[1]) for k, v in self._ns.objects.items() if k.startswith(prefix)]
        items.sort(key=lambda item: item[0])
        return items

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        # A snapshot taken now, so the caller may delete or put while iterating.
        return iter([ObjectInfo(k, len(b), t) for k, b, t in self._snapshot(prefix)])

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        names: list[str] = []
        folders: set[str] = set()
        for k, _, _ in self._snapshot(prefix):
            head, sep, _ = k[len(prefix) :].partition("/")
            if sep:
                folders.add(head)
            else:
                names.append(head)
        return names, sorted(folders)

    def head(self, key: str) -> ObjectInfo:
        data, mtime = self._entry(key)
        return ObjectInfo(key, len(data), mtime)

    def copy(self, src_key: str, dst_key: str) -> None:
        self._set(check_key(dst_key), self._entry(src_key)[0])  # immutable: the copy can share it
