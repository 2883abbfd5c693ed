"""Bodies as lists of memoryviews: the S3 store's parts and ranged reads, without copies.

Invariant: nothing here copies more than it is asked for, so a multipart upload joins at most
one part per worker, never the whole object (see ``_s3_multipart``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

MiB = 1 << 20


def join(views: list[memoryview]) -> bytes:
    if len(views) == 1 and isinstance(views[0].obj, bytes) and views[0].nbytes == len(views[0].obj):
        return views[0].obj  # already immutable bytes: no copy
    return b"".join(views)


def slice_views(views: Sequence[memoryview], ends: Sequence[int], start: int, n: int) -> list[memoryview]:
    """The views covering bytes [start, start + n) of the concatenation of ``views``, whose
    cumulative end offsets are ``ends``."""
    out = []
    lo = 0
    for v, end in zip(views, ends, strict=True):
        if end > start and lo < start + n:
            a = max(start, lo) - lo
            b = min(start + n, end) - lo
            out.append(v[a:b])
        lo = end
        if lo >= start + n:
            break
    return out


def cumulative(views: Sequence[memoryview]) -> list[int]:
    return list(itertools.accumulate(v.nbytes for v in views))


def stream_into(body: Any, views: list[memoryview]) -> int:
    """Copy a response body into ``views``; returns the bytes copied (short at end of body)."""
    got = 0
    for v in views:
        pos = 0
        while pos < v.nbytes:
            chunk = body.read(min(v.nbytes - pos, 4 * MiB))
            if not chunk:
                return got + pos
            v[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        got += pos
    return got
