"""The job roots a daemon serves, and the check that a request's root lies inside one of them.

A request names one job root URI. It is accepted when it is a served root or lies below one
(``--root s3://bucket/jobs`` serves ``s3://bucket/jobs/run-7``), compared component by component
after normalising, so ``s3://bucket/jobs-evil`` or ``/srv/ckpt/../etc`` never pass.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

__all__ = ["RootError", "Roots", "normalize"]

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


class Roots:
    """The served roots. ``check(uri)`` returns ``uri`` or raises RootError."""

    def __init__(self, uris: list[str]):
        if not uris:
            raise RootError("no job root to serve (give --root URI)")
        self.uris = list(uris)
        self._norm = [normalize(u) for u in uris]

    def check(self, uri: str) -> str:
        scheme, comps = normalize(uri)
        for s, c in self._norm:
            if s == scheme and comps[: len(c)] == c:
                return uri
        raise RootError(f"job root {uri!r} is not served by this daemon (serving: {', '.join(self.uris)})")

    def only(self) -> str | None:
        return self.uris[0] if len(self.uris) == 1 else None
