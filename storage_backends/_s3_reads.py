"""The S3 store's reads: whole objects and ranges as (parallel) ranged GETs.

Invariants: a read never stitches two versions of an object together (every piece after the
first carries ``If-Match`` with the first one's ETag; a 412 starts the read again, up to three
times); a buffer is never allocated for more than the caller's ``limit`` or
``CKPTD_S3_MAX_GET_BYTES`` (64 GiB) before the server's size is checked against them; and a server
that sends more than the range asked for is refused rather than buffered.

``Reads`` is a mixin of ``S3Store`` (``storage_backends.s3``) and uses its helpers.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from storage_backends._s3_buffers import cumulative, slice_views, stream_into
from storage_backends._s3_calls import InvalidRange, PreconditionFailed, Truncated
from storage_backends.base import ObjectInfo, StorageError, as_writable_buffers, check_key, check_limit, resolve_range

__all__ = ["Reads"]

T = TypeVar("T")
_MAX_GET_BYTES = int(os.environ.get("CKPTD_S3_MAX_GET_BYTES", str(64 << 30)))


def _total_size(resp: dict) -> int | None:
    """The object's size from a ranged response's ``Content-Range: bytes a-b/total``."""
    m = re.search(r"/(\d+)\s*$", resp.get("ContentRange") or "")
    return int(m.group(1)) if m else None


class Reads:
    """GetObject and HeadObject verbs of ``S3Store``."""

    @property
    def _one_get(self) -> int:
        """The longest range read in one GET, like the largest object written in one PUT (two
        parts by default): a shard a little over one part costs one request, not a HEAD (for
        the size and the ETag that pins the pieces) and two GETs."""
        return max(self.part_size, self.multipart_threshold)

    def _get_into(self, key: str, start: int, views: list[memoryview], if_match: str | None = None) -> dict:
        """One ranged GET streamed into ``views``; returns the response (its ETag, ContentRange).
        A negative ``start`` asks for the last ``-start`` bytes and keeps the first ones."""
        n = sum(v.nbytes for v in views)
        want = -start if start < 0 else n
        outside = f"{self._where(key)}: range start={start} length={n} is outside the object"
        if want < n:
            raise StorageError(outside)
        rng = f"bytes=-{want}" if start < 0 else f"bytes={start}-{start + n - 1}"
        extra = {"IfMatch": if_match} if if_match else {}

        def attempt() -> dict:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key), Range=rng, **extra)
            with contextlib.closing(resp["Body"]) as body:
                if resp["ContentLength"] != want:  # S3 truncates a range that runs past the end
                    raise StorageError(f"{outside} ({_total_size(resp)} bytes)")
                if stream_into(body, views) != n:
                    raise Truncated(f"response body ended early ({rng})")
            return resp

        try:
            return self._call("GetObject", key, attempt)
        except InvalidRange:  # 416: the range starts at or past the end
            raise StorageError(outside) from None

    def get(self, key: str, limit: int | None = None) -> bytes:
        """A large object is fetched as parallel ranged GETs into one buffer, then copied once
        into ``bytes`` (``get_range_into`` fills the caller's buffers without that copy); the
        first GET asks for at most one part."""
        return self._again(key, lambda: self._get_whole(key, limit))

    def _again(self, key: str, read: Callable[[], T]) -> T:
        """``read()``, started again while the object is replaced under it (a piece's
        ``If-Match`` fails), up to three times."""
        for _ in range(3):
            with contextlib.suppress(PreconditionFailed):
                return read()
        raise StorageError(f"{self._where(key)}: GetObject failed: the object kept changing while read")

    def _get_whole(self, key: str, limit: int | None = None) -> bytes:
        # The first piece also tells the size (Content-Range), so a small object costs one GET.
        first_len = self.part_size if limit is None else max(1, min(self.part_size, limit + 1))
        try:
            first, resp = self._get_first(key, f"bytes=0-{first_len - 1}")
        except InvalidRange:  # a ranged GET of an empty object is a 416
            return self._get_first(key, None)[0]  # an empty object: at most 0 bytes expected
        if len(first) > first_len:  # a server ignoring the Range: never trust its size
            raise StorageError(
                f"{self._where(key)}: GetObject returned {len(first)} bytes for a {first_len}-byte range"
            )
        total = _total_size(resp) or len(first)
        check_limit(self.uri, key, total, limit)
        check_limit(self.uri, key, total, _MAX_GET_BYTES)
        if total <= len(first):
            return first
        got = len(first)
        buf = bytearray(total)
        buf[:got] = first
        del first
        self._pieces_into(key, got, total - got, [memoryview(buf)[got:]], resp["ETag"])
        return bytes(buf)

    def _get_first(self, key: str, rng: str | None) -> tuple[bytes, dict]:
        """One GET; reads at most the range's length (0 without one) + 1 bytes of the body, so a
        server that sends more than asked cannot make us buffer it."""
        extra = {"Range": rng} if rng else {}
        most = int(rng.rsplit("-", 1)[1]) + 1 if rng else 0

        def attempt() -> tuple[bytes, dict]:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key), **extra)
            with contextlib.closing(resp["Body"]) as body:
                data = body.read(most + 1)
            if len(data) > most:
                raise StorageError(f"{self._where(key)}: GetObject sent more than the {most} bytes asked for")
            if len(data) != resp["ContentLength"]:
                raise Truncated("response body ended early")
            return data, resp

        return self._call("GetObject", key, attempt)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._get_range(key, start, length, self._one_get)

    def _get_range(self, key: str, start: int, length: int, one_get: int) -> bytes:
        buf = bytearray(max(length, 0))
        self._range_into(key, start, length, [memoryview(buf)], one_get)
        return bytes(buf)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_key(key)
        # Each range in a single GET, whatever its size: the ranges already go in parallel.
        return self._submit_all([lambda s=s, n=n: self._get_range(key, s, n, n) for s, n in ranges])

    def get_range_into(self, key: str, start: int, buffers: Sequence[bytearray | memoryview]) -> None:
        views = as_writable_buffers(buffers)
        self._range_into(key, start, sum(v.nbytes for v in views), views, self._one_get)

    def _range_into(self, key: str, start: int, length: int, views: list[memoryview], one_get: int) -> None:
        """Into ``views``: in one GET up to ``one_get`` bytes, else as parallel part-sized GETs."""
        check_key(key)
        if 0 < length <= one_get:
            self._get_into(key, start, views)
            return

        # Empty or large: learn the size first, and the ETag that pins the pieces to one version.
        def read() -> None:
            info = self._head(key)
            pos = resolve_range(self.uri, key, start, length, info["ContentLength"])
            self._pieces_into(key, pos, length, views, info["ETag"])

        self._again(key, read)

    def _pieces_into(self, key: str, pos: int, length: int, views: list[memoryview], etag: str) -> None:
        """Bytes [pos, pos + length) into ``views`` as parallel part-sized GETs."""
        ends = cumulative(views)

        def piece(off: int, n: int) -> None:
            self._get_into(key, pos + off, slice_views(views, ends, off, n), if_match=etag)

        steps = range(0, length, self.part_size)
        self._submit_all([lambda o=o: piece(o, min(self.part_size, length - o)) for o in steps])

    def _head(self, key: str) -> dict:
        return self._call("HeadObject", key, self._client.head_object, Bucket=self.bucket, Key=self._full(key))

    def head(self, key: str) -> ObjectInfo:
        resp = self._head(key)
        return ObjectInfo(key, resp["ContentLength"], resp["LastModified"].timestamp())
