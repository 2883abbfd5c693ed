"""From a job root URI to a Store, by scheme.

Built in: a plain path or ``file://`` (LocalStore), ``memory://`` (MemoryStore), ``s3://``
(S3Store, imported on first use so that boto3 loads only when needed). Other schemes can be
plugged in with :func:`register_scheme`, as torchsnapshot finds storage plugins by URL scheme.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from storage_backends.base import StorageError, Store
from storage_backends.local import LocalStore
from storage_backends.memory import MemoryStore

__all__ = ["StoreFactory", "UnknownSchemeError", "open_store", "register_scheme", "supported_schemes"]

# A factory gets the whole URI and returns an open store.
StoreFactory = Callable[[str], Store]


class UnknownSchemeError(StorageError, ValueError):
    """The URI's scheme has no registered backend."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _open_file(uri: str) -> Store:
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageError(f"{uri}: file URIs name no host (use file:///abs/path)")
    if not parts.path:
        raise StorageError(f"{uri}: no path")
    return LocalStore(unquote(parts.path))


def _open_memory(uri: str) -> Store:
    name = uri[len("memory://") :]
    if not name:
        raise StorageError(f"{uri}: memory URIs need a name (memory://name)")
    return MemoryStore(name)


def _open_s3(uri: str) -> Store:
    from storage_backends.s3 import S3Store

    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket (use s3://bucket/prefix)")
    return S3Store(bucket, prefix)


_factories: dict[str, StoreFactory] = {"file": _open_file, "memory": _open_memory, "s3": _open_s3}
_lock = threading.Lock()


def register_scheme(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store`` hand URIs of ``scheme`` (e.g. ``"gs"``) to ``factory(uri)``.
    Registering a scheme again replaces its factory."""
    scheme = scheme.lower().removesuffix("://")
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"invalid URI scheme {scheme!r}")
    with _lock:
        _factories[scheme] = factory


def supported_schemes() -> list[str]:
    with _lock:
        return sorted(_factories)


def open_store(uri: str) -> Store:
    """The store for a job root URI: ``/abs/path``, ``file:///abs/path``, ``memory://name``,
    ``s3://bucket/prefix``, or a registered scheme. A relative path is made absolute against the
    current directory (a store must not change meaning when the process changes directory)."""
    if not isinstance(uri, str) or not uri:
        raise StorageError(f"invalid store URI {uri!r}")
    m = _SCHEME.match(uri)
    if m is None:
        return LocalStore(os.path.abspath(uri))
    scheme = m.group(1).lower()
    with _lock:
        factory = _factories.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in supported_schemes())
        raise UnknownSchemeError(f"unsupported URI scheme {scheme!r} in {uri!r}; supported: a path, {known}")
    return factory(uri)
