"""The job roots a daemon serves, and the check that a request's root lies inside one of them.

A request names one job root URI. It is accepted when it is a served root or lies below one
(``--root s3://bucket/jobs`` serves ``s3://bucket/jobs/run-7``), compared component by component
after normalising, so ``s3://bucket/jobs-evil`` or ``/srv/ckpt/../etc`` never pass.

On a filesystem the names below a served root are the job's users' to make, links included: a
link ``served/link -> /elsewhere`` must not let a request reach ``/elsewhere/theirjob``. So a
request whose path below its served root passes through a link is refused (``check``), and the
store the daemon opens for such a root (``open_store``) opens every level below the served root
with ``O_NOFOLLOW`` (``LocalStore(below=...)``), so a link planted after the check is not followed
either. The served root itself may be a link: the operator chose it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

from storage_backends import Store, open_store

__all__ = ["RootError", "Roots", "innermost", "inside", "normalize"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class RootError(ValueError):
    """The root is malformed or not served: the request is bad (HTTP 400)."""


def normalize(uri: str) -> tuple[str, tuple[str, ...]]:
    """(scheme or "file", path components). Raises RootError on ``.``/``..``/empty components."""
    if not isinstance(uri, str) or not uri or "\x00" in uri:
        raise RootError(f"invalid job root {uri!r}")
    m = _SCHEME.match(uri)
    if m is None:
        if not os.path.isabs(uri):
            raise RootError(f"job root {uri!r} must be an absolute path or a URI")
        scheme, path = "file", uri
    else:
        scheme = m.group(1).lower()
        if scheme == "file":
            parts = urlsplit(uri)
            if parts.netloc not in ("", "localhost"):
                raise RootError(f"job root {uri!r}: file URIs name no host")
            path = unquote(parts.path)
        else:
            path = uri[m.end() :]
    comps = tuple(c for c in path.split("/") if c != "")
    if any(c in (".", "..") for c in comps):
        raise RootError(f"job root {uri!r} must not contain '.' or '..' components")
    if scheme != "file" and not comps:
        raise RootError(f"job root {uri!r} names no bucket or name")
    return scheme, comps


def inside(inner: tuple[str, tuple[str, ...]], outer: tuple[str, tuple[str, ...]]) -> bool:
    """Whether the normalised root ``inner`` is ``outer`` or lies below it."""
    return inner[0] == outer[0] and inner[1][: len(outer[1])] == outer[1]


def innermost(key: tuple[str, tuple[str, ...]], items: Iterable[tuple[tuple, Any]]) -> tuple[tuple, Any] | None:
    """The (normalised root, value) of ``items`` innermost around ``key`` (the first of equals), or None."""
    return max(((k, v) for k, v in items if inside(key, k)), key=lambda kv: len(kv[0][1]), default=None)


class Roots:
    """The served roots. ``check(uri)`` returns ``uri`` or raises RootError."""

    def __init__(self, uris: list[str]):
        if not uris:
            raise RootError("no job root to serve (give --root URI)")
        self.uris = list(uris)
        self._norm = [(normalize(u), u) for u in uris]

    def check(self, uri: str) -> str:
        self._served(uri)
        return uri

    def _served(self, uri: str, links: bool = True) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """(scheme, the served root's components, the request's) of the most specific served
        root containing ``uri``; for a folder (``links``), checks that nothing below the served
        root is a link."""
        scheme, comps = normalize(uri)
        held = innermost((scheme, comps), self._norm)
        if held is None:
            raise RootError(f"job root {uri!r} is not served by this daemon (serving: {', '.join(self.uris)})")
        best = held[0][1]
        if scheme == "file" and links:
            _no_links_below(uri, best, comps)
        return scheme, best, comps

    def open_store(self, uri: str, owner: Callable[[], tuple[int, int] | None] | None = None) -> Store:
        """The store of a served job root; for a folder, a ``LocalStore(below=...)`` that never
        follows a link below the served root (the module's docstring says why). ``owner``: who
        what it makes in a local root belongs to (``LocalStore``)."""
        scheme, base, comps = self._served(uri, links=False)
        if scheme != "file":
            return open_store(uri)
        from storage_backends.local import LocalStore

        return LocalStore("/" + "/".join(comps), below="/" + "/".join(base), owner=owner)

    def containing(self, uri: str) -> str | None:
        """The most specific served root containing ``uri``; None when none does (or it is no root)."""
        with contextlib.suppress(RootError):
            held = innermost(normalize(uri), self._norm)
            return held and held[1]
        return None

    def only(self) -> str | None:
        return self.uris[0] if len(self.uris) == 1 else None


def _no_links_below(uri: str, base: tuple[str, ...], comps: tuple[str, ...]) -> None:
    """RootError when a folder on the way from the served root ``base`` to ``comps`` is a link
    or not a folder; missing levels are fine (a first save creates them)."""
    path = "/" + "/".join(base)
    for name in comps[len(base) :]:
        path = f"{path}/{name}"
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                break
            raise RootError(f"job root {uri!r}: cannot check {path}: {e.strerror or e}") from None
        if stat.S_ISLNK(mode):
            raise RootError(
                f"job root {uri!r} is not served by this daemon: {path} is a symbolic link below the served root"
            )
        if not stat.S_ISDIR(mode):
            break
    else:
        return
    raise RootError(f"job root {uri!r}: {path} is not a folder")
