"""A store on any S3-compatible object store (AWS S3, MinIO, Ceph RGW, ...) through botocore.

``s3://bucket/prefix``: keys live under ``prefix/`` in ``bucket``. Endpoint, region and
credentials come from the standard variables, read the way boto3 reads them (a boto3 client is
a botocore client; we create it through botocore directly to share the parsed service model):
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (botocore reads these itself),
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, profiles, instance roles.
Region: ``AWS_REGION``, then whatever boto3 finds (``AWS_DEFAULT_REGION``, the config file);
botocore itself does not read ``AWS_REGION``, so we pass it.

One botocore client and one thread pool per store, both thread-safe and shared by every call:
large objects are uploaded as multipart uploads whose parts go up in parallel, and read back as
parallel ranged GETs. Tuning: ``CKPTD_S3_PART_SIZE`` (default 16 MiB) and
``CKPTD_S3_MULTIPART_THRESHOLD`` (default two parts) (bytes, or with a K/M/G suffix, binary) and
``CKPTD_S3_WORKERS``, or the constructor's arguments.

Integrity: every PUT carries botocore's CRC32 of its body (unless
``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``), and every chunk its crc32c. Over http the
body is also SHA-256 signed, until a response echoes the CRC32 (``x-amz-checksum-crc32``): a
server that does (AWS, MinIO) checks it, and the store stops signing payloads,
which saves a hash of every byte on endpoints without TLS. Ceph RGW 16.2 neither echoes nor
checks it (it stores a body corrupted in flight), so there every body stays signed, and a
corrupted one is refused (XAmzContentSHA256Mismatch). Over https botocore never signs payloads
that carry a checksum.

Retries: botocore's own ("standard" mode), plus ours around each call (see ``_s3_calls``), and
by default adaptive pacing (``s3_retry``): after a SlowDown (503, throttling) in a scope (the first
folder below the root: one step's objects) every thread of the store sends fewer requests per
second there, a token bucket whose rate drops to 0.7x on a throttle and grows back on successes.
``CKPTD_S3_RETRY_MODE=standard`` turns pacing off; ``CKPTD_S3_MIN_RATE`` (requests/s, default 0.2)
is the floor a scope's rate is never cut below.

``purge`` sends its DeleteObjects (1000 keys each) from ``CKPTD_S3_DELETE_WORKERS`` (default 4)
threads at once, retries the keys a batch reports as failed, and fails naming the rest.

``put_if_absent`` needs conditional writes: ``If-None-Match: *`` on PutObject, which AWS S3
(since 2024-08), MinIO, Ceph RGW (16.2 Pacific, tested for real) and moto honour with 412
PreconditionFailed. It is therefore always one PutObject, up to S3's single-PUT limit of 5 GiB
(``max_put_size``), never a multipart upload: Ceph RGW 16.2 (Pacific) ignores If-None-Match on
CompleteMultipartUpload and overwrites the object, so a multipart put_if_absent there would make
every racing writer win. Above that limit it is a multipart upload whose Complete carries the
condition, only once a probe (run once per store) showed that the server refuses such a Complete
over an existing object; a server that ignores it gets one clear StorageError instead.
(moto's server tests and writes without a lock, so two racing writers could in theory both win
there, which real S3 rules out.) A store that silently ignores the header on PutObject too would
make every writer win; don't point ckptd at one.
A missing bucket is an empty store for reads, but puts do not create buckets (that needs
permissions and a region choice that belong to the operator): they fail with NoSuchBucket.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from botocore.config import Config

from storage_backends._s3_calls import (
    RETRY_CODES,
    Caller,
    InvalidRange,
    NoSuchBucket,
    NoSuchUpload,
    PreconditionFailed,
    Truncated,
    env_number,
    env_size,
    new_client,
)
from storage_backends.base import (
    Data,
    ExistsError,
    NotFoundError,
    ObjectInfo,
    StorageError,
    Store,
    as_buffers,
    as_writable_buffers,
    check_dir_prefix,
    check_key,
    check_limit,
    check_prefix,
    resolve_range,
)
from storage_backends.s3_retry import DEFAULT_MIN_RATE, AdaptiveLimiter, Pacer

__all__ = [
    "DEFAULT_DELETE_WORKERS",
    "DEFAULT_PART_SIZE",
    "DEFAULT_WORKERS",
    "MAX_PARTS",
    "MAX_PUT_SIZE",
    "MIN_PART_SIZE",
    "S3Store",
]

MiB = 1 << 20
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_WORKERS = 16
DEFAULT_DELETE_WORKERS = 4  # DeleteObjects in flight at once in ``purge``
DELETE_BATCH = 1000  # S3's most keys per DeleteObjects
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum parts per upload
MAX_PUT_SIZE = 5 << 30  # S3's maximum for one PutObject
T = TypeVar("T")
_WRITER_META = "ckptd-writer"  # user metadata naming the put_if_absent call that wrote an object


class _Changed(Exception):
    """The object was replaced while we read it in pieces; read it again."""


def _join(views: list[memoryview]) -> bytes:
    if len(views) == 1 and isinstance(views[0].obj, bytes) and views[0].nbytes == len(views[0].obj):
        return views[0].obj  # already immutable bytes: no copy
    return b"".join(views)


def _slice(views: Sequence[memoryview], ends: Sequence[int], start: int, n: int) -> list[memoryview]:
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


def _cumulative(views: Sequence[memoryview]) -> list[int]:
    ends, total = [], 0
    for v in views:
        total += v.nbytes
        ends.append(total)
    return ends


def _stream_into(body: Any, views: list[memoryview]) -> int:
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


_MAX_GET_BYTES = int(os.environ.get("CKPTD_S3_MAX_GET_BYTES", str(64 << 30)))


def _total_size(resp: dict) -> int | None:
    """The object's size from a ranged response's ``Content-Range: bytes a-b/total``."""
    m = re.search(r"/(\d+)\s*$", resp.get("ContentRange") or "")
    return int(m.group(1)) if m else None


class S3Store(Store):
    """``s3://bucket/prefix``.

    Thread-safe: every method may be called from many threads; they share one client (whose
    connection pool is sized for the thread pool plus callers) and one thread pool. Calls made
    from inside that pool never wait on it, so it cannot deadlock.

    ``put`` is atomic as S3 is (a GET sees the old or the new object). A ``get`` of an object in
    several ranged pieces pins the ETag of the first piece (``If-Match``), so it never stitches
    two versions together; it starts again if the object is replaced mid-read.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int | None = None,
        multipart_threshold: int | None = None,
        max_workers: int | None = None,
        max_attempts: int | None = None,
        retries: int | None = None,
        backoff: float = 0.2,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_put_size: int = MAX_PUT_SIZE,
        retry_mode: str | None = None,
        min_rate: float | None = None,
        delete_workers: int | None = None,
    ) -> None:
        """``max_attempts`` is botocore's per-call attempts; ``retries`` our extra tries around
        those, sleeping up to ``backoff * 2**n`` seconds (full jitter, capped at 10 s).

        Every call has a deadline: ``connect_timeout`` to connect and ``read_timeout`` for each
        wait on the server, per attempt; so a call to an endpoint that stops answering fails
        after about ``max_attempts * (retries + 1) * read_timeout`` seconds. Unset, they come
        from ``CKPTD_S3_CONNECT_TIMEOUT`` (10), ``CKPTD_S3_READ_TIMEOUT`` (60),
        ``CKPTD_S3_MAX_ATTEMPTS`` (8) and ``CKPTD_S3_RETRIES`` (4). A save as a whole is also
        bounded by ``Checkpointer(save_timeout=...)``.

        ``max_put_size``: the largest object ``put_if_absent`` sends as one conditional PutObject
        (the server's single-PUT limit); larger ones need a server whose CompleteMultipartUpload
        honours If-None-Match (see the module's docstring).

        ``retry_mode``: ``"adaptive"`` (default; ``CKPTD_S3_RETRY_MODE``) paces the store after
        throttling, at no less than ``min_rate`` requests/s per scope (``CKPTD_S3_MIN_RATE``, 0.2);
        ``"standard"`` only retries. ``delete_workers``: DeleteObjects in flight at once in
        ``purge`` (``CKPTD_S3_DELETE_WORKERS``, 4)."""
        if max_attempts is None:
            max_attempts = int(env_number("CKPTD_S3_MAX_ATTEMPTS", 8))
        if retries is None:
            retries = int(env_number("CKPTD_S3_RETRIES", 4))
        if connect_timeout is None:
            connect_timeout = env_number("CKPTD_S3_CONNECT_TIMEOUT", 10.0)
        if read_timeout is None:
            read_timeout = env_number("CKPTD_S3_READ_TIMEOUT", 60.0)
        if retry_mode is None:
            retry_mode = os.environ.get("CKPTD_S3_RETRY_MODE", "").strip() or "adaptive"
        if retry_mode not in ("adaptive", "standard"):
            raise ValueError(f"S3 retry mode {retry_mode!r}: expected 'adaptive' or 'standard'")
        if min_rate is None:
            min_rate = env_number("CKPTD_S3_MIN_RATE", DEFAULT_MIN_RATE)
        if delete_workers is None:
            delete_workers = int(env_number("CKPTD_S3_DELETE_WORKERS", DEFAULT_DELETE_WORKERS))
        self.delete_workers = max(1, delete_workers)
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_prefix(prefix)
        self.bucket = bucket
        self._prefix = prefix + "/" if prefix else ""
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

        part_size = part_size if part_size is not None else env_size("CKPTD_S3_PART_SIZE", DEFAULT_PART_SIZE)
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 part size {part_size} is below S3's minimum of {MIN_PART_SIZE} bytes")
        self.part_size = part_size
        # Up to two parts' worth goes as one PUT: an object a little over one part would
        # otherwise become four requests (create, two parts, complete) for one part of data.
        self.multipart_threshold = (
            multipart_threshold
            if multipart_threshold is not None
            else env_size("CKPTD_S3_MULTIPART_THRESHOLD", 2 * part_size)
        )
        workers = max_workers or int(os.environ.get("CKPTD_S3_WORKERS") or DEFAULT_WORKERS)

        # With a custom endpoint (MinIO, Ceph, moto) use path-style addressing: virtual hosts
        # like bucket.localhost rarely resolve there; AWS accepts both.
        env = os.environ
        custom_endpoint = endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        config = Config(
            # Pool workers plus caller threads each hold a connection; botocore's default of 10
            # would make them queue (and log "connection pool is full").
            max_pool_connections=workers + 16,
            # total_max_attempts counts the first try; botocore's "max_attempts" would not.
            retries={"mode": "standard", "total_max_attempts": max(1, max_attempts)},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            tcp_keepalive=True,
            s3={"addressing_style": "path"} if custom_endpoint else None,
        )
        # endpoint_url=None lets botocore read AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL itself.
        self._client = new_client(region or os.environ.get("AWS_REGION") or None, endpoint_url, config)
        self.endpoint_url: str = self._client.meta.endpoint_url
        self._caller = Caller(bucket, self.endpoint_url, retries + 1, backoff)
        # One limiter for the whole store: every thread's requests (botocore's retries too) pass it.
        self.limiter: AdaptiveLimiter | None = None
        self._pacer: Pacer | None = None
        if retry_mode == "adaptive":
            self.limiter = AdaptiveLimiter(min_rate)
            self._pacer = Pacer(self.limiter)
            self._pacer.attach(self._client.meta.events)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-s3")
        self.max_put_size = max_put_size
        self._checksums_checked = False  # the server showed it checks our CRC32s
        self._conditional_complete: bool | None = None  # the probe's answer, once known
        self._closed = False
        self._close_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._prefix}{key}"

    def _call(self, op: str, key: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
        where = self._where(key) if key else self.uri
        if self._pacer is None:
            return self._caller(op, where, fn, **kwargs)
        with self._pacer.scoped(key):
            return self._caller(op, where, fn, **kwargs)

    def _submit_all(self, fns: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``fns`` on the pool (the last one in this thread) and return their results; on the
        first failure cancel what has not started, wait for the rest, and raise it."""
        if not fns:
            return []
        futures: list[Future[T]] = [self._pool.submit(fn) for fn in fns[:-1]]
        try:
            last = fns[-1]()
            return [f.result() for f in futures] + [last]
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
            raise

    # -- reads ------------------------------------------------------------------------------------

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
                if _stream_into(body, views) != n:
                    raise Truncated(f"response body ended early ({rng})")
            return resp

        try:
            return self._call("GetObject", key, attempt)
        except InvalidRange:  # 416: the range starts at or past the end
            raise StorageError(outside) from None

    def get(self, key: str, limit: int | None = None) -> bytes:
        """A large object is fetched as parallel ranged GETs into one buffer, then copied once
        into ``bytes``; ``get_range_into`` fills the caller's buffers without that copy. The size
        the server reports is checked against ``limit`` (and ``CKPTD_S3_MAX_GET_BYTES``, 64 GiB by
        default) before that buffer is allocated, and the first GET asks for at most one part."""
        for _ in range(3):
            try:
                return self._get_whole(key, limit)
            except _Changed:
                continue
        raise StorageError(f"{self._where(key)}: GetObject failed: the object kept changing while read")

    def _get_whole(self, key: str, limit: int | None = None) -> bytes:
        # The first piece also tells the size (Content-Range), so a small object costs one GET.
        first_len = self.part_size if limit is None else max(1, min(self.part_size, limit + 1))
        try:
            first, resp = self._get_first(key, f"bytes=0-{first_len - 1}")
        except InvalidRange:  # a ranged GET of an empty object is a 416
            return self._get_first(key, None, 0)[0]  # an empty object: at most 0 bytes expected
        if len(first) > first_len:  # a server ignoring the Range: never trust its size
            raise StorageError(
                f"{self._where(key)}: GetObject returned {len(first)} bytes for a {first_len}-byte range"
            )
        total = _total_size(resp) or len(first)
        check_limit(self.uri, key, total, limit)
        check_limit(self.uri, key, total, _MAX_GET_BYTES)
        if total <= len(first):
            return first
        buf = bytearray(total)
        mv = memoryview(buf)
        got = len(first)
        mv[:got] = first
        del first
        etag = resp["ETag"]
        pieces = [(off, min(self.part_size, total - off)) for off in range(got, total, self.part_size)]
        try:
            self._submit_all(
                [lambda o=o, n=n: self._get_into(key, o, [mv[o : o + n]], if_match=etag) for o, n in pieces]
            )
        except PreconditionFailed:
            raise _Changed() from None
        return bytes(buf)

    def _get_first(self, key: str, rng: str | None, most: int | None = None) -> tuple[bytes, dict]:
        """One GET; reads at most ``most`` bytes (the range's length) + 1 of the body, so a
        server that sends more than asked cannot make us buffer it."""
        extra = {"Range": rng} if rng else {}
        if most is None:
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
        if length <= 0 or length > self.part_size:
            buf = bytearray(max(length, 0))
            self._range_into(key, start, length, [memoryview(buf)] if length > 0 else [])
            return bytes(buf)
        return self._get_range_one(key, start, length)

    def _get_range_one(self, key: str, start: int, length: int) -> bytes:
        """A range in a single GET, whatever its size (what get_ranges' pool tasks use)."""
        if length <= 0:
            self._range_into(key, start, length, [])
            return b""
        buf = bytearray(length)
        self._get_into(key, start, [memoryview(buf)])
        return bytes(buf)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_key(key)
        return self._submit_all([lambda s=s, n=n: self._get_range_one(key, s, n) for s, n in ranges])

    def get_range_into(self, key: str, start: int, buffers: Sequence[bytearray | memoryview]) -> None:
        views = as_writable_buffers(buffers)
        self._range_into(key, start, sum(v.nbytes for v in views), views)

    def _range_into(self, key: str, start: int, length: int, views: list[memoryview]) -> None:
        check_key(key)
        if 0 < length <= self.part_size:
            self._get_into(key, start, views)
            return
        # Empty or large: learn the size first, and the ETag that pins the pieces to one version.
        for _ in range(3):
            info = self._head(key)
            pos = resolve_range(self.uri, key, start, length, info["ContentLength"])
            try:
                self._pieces_into(key, pos, length, views, info["ETag"])
                return
            except PreconditionFailed:
                continue
        raise StorageError(f"{self._where(key)}: GetObject failed: the object kept changing while read")

    def _pieces_into(self, key: str, pos: int, length: int, views: list[memoryview], etag: str) -> None:
        """Bytes [pos, pos + length) into ``views`` as parallel part-sized GETs."""
        ends = _cumulative(views)

        def piece(off: int, n: int) -> None:
            self._get_into(key, pos + off, _slice(views, ends, off, n), if_match=etag)

        steps = range(0, length, self.part_size)
        self._submit_all([lambda o=o: piece(o, min(self.part_size, length - o)) for o in steps])

    def _head(self, key: str) -> dict:
        return self._call("HeadObject", key, self._client.head_object, Bucket=self.bucket, Key=self._full(key))

    def head(self, key: str) -> ObjectInfo:
        resp = self._head(key)
        return ObjectInfo(key, resp["ContentLength"], resp["LastModified"].timestamp())

    def _paged(
        self, op: str, fn: Callable[..., dict], key_prefix: str, after: Callable[[dict], dict | None], **kwargs: Any
    ) -> Iterator[dict]:
        """Every page of the listing ``op`` of keys starting with ``key_prefix`` (relative);
        ``after(page)`` gives the markers of the page after ``page``, None after the last one. A
        missing root is an empty store."""
        markers: dict = {}
        while True:
            try:
                page = self._call(
                    op, key_prefix, fn, Bucket=self.bucket, Prefix=self._prefix + key_prefix, **kwargs, **markers
                )
            except NoSuchBucket:
                return
            yield page
            nxt = after(page)
            if nxt is None:
                return
            markers = nxt

    def _pages(self, key_prefix: str, **kwargs: Any) -> Iterator[dict]:
        def after(page: dict) -> dict | None:
            token = page.get("NextContinuationToken")
            return {"ContinuationToken": token} if page.get("IsTruncated") and token else None

        return self._paged("ListObjectsV2", self._client.list_objects_v2, key_prefix, after, **kwargs)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        strip = len(self._prefix)
        for page in self._pages(prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"][strip:]
                if key and not key.endswith("/"):  # skip "folder markers" other tools make
                    yield ObjectInfo(key, obj["Size"], obj["LastModified"].timestamp())

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        strip = len(self._prefix) + len(prefix)
        names, folders = [], []
        for page in self._pages(prefix, Delimiter="/"):
            names += [o["Key"][strip:] for o in page.get("Contents", []) if o["Key"][strip:]]
            folders += [p["Prefix"][strip:].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names), sorted(f for f in folders if f)

    def list_dir_after(self, prefix: str, after: str) -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        strip = len(self._prefix) + len(prefix)
        names, folders = [], []
        for page in self._pages(prefix, Delimiter="/", StartAfter=self._prefix + prefix + after):
            names += [o["Key"][strip:] for o in page.get("Contents", []) if o["Key"][strip:] > after]
            folders += [p["Prefix"][strip:].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names), sorted(f for f in folders if f > after)

    def exists_root(self) -> bool:
        try:
            self._call("HeadBucket", "", self._client.head_bucket, Bucket=self.bucket)
        except NotFoundError:
            return False
        return True

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: str, data: Data) -> None:
        full = self._full(key)
        views = as_buffers(data)
        size = sum(v.nbytes for v in views)
        if size <= self.multipart_threshold:
            resp = self._call(
                "PutObject", key, self._client.put_object, Bucket=self.bucket, Key=full, Body=_join(views)
            )
            self._saw_checksum(resp)
        else:
            self._put_multipart(key, views, size)

    def put_if_absent(self, key: str, data: Data) -> bool:
        full = self._full(key)
        views = as_buffers(data)
        size = sum(v.nbytes for v in views)
        # Our token in the object's metadata tells, on a 412, whether the object there is ours:
        # when a response is lost and the PUT retried (by botocore or by us), the retry meets the
        # object the first try wrote, and that call still won.
        token = secrets.token_hex(16)
        meta = {_WRITER_META: token}
        try:
            # One PutObject even above the multipart threshold: its If-None-Match is honoured
            # everywhere, CompleteMultipartUpload's is not (Ceph RGW 16.2 overwrites).
            if size <= self.max_put_size:
                self._put_object_if_none_match(key, full, views, meta)
            else:
                if self.exists(key):  # don't upload gigabytes only to lose
                    return False
                self._require_conditional_complete(key, size)
                self._put_multipart(key, views, size, metadata=meta, if_none_match=True)
        except PreconditionFailed:
            try:
                return self._head(key).get("Metadata", {}).get(_WRITER_META) == token
            except NotFoundError:  # the winner's object is already deleted again
                return False
        return True

    def _put_object_if_none_match(self, key: str, full: str, views: list[memoryview], meta: dict) -> dict:
        """One PutObject with ``If-None-Match: *`` (a 412 raises PreconditionFailed)."""
        resp = self._call(
            "PutObject",
            key,
            self._client.put_object,
            Bucket=self.bucket,
            Key=full,
            Body=_join(views),
            IfNoneMatch="*",
            Metadata=meta,
        )
        self._saw_checksum(resp)
        return resp

    def put_new(self, key: str, data: Data) -> str:
        """Create-only: PutObject with ``If-None-Match: *`` (a 412 is ExistsError, unless the
        object there carries this call's token: a retried PUT whose first try landed). Above the
        multipart threshold a multipart upload whose Complete carries the condition, where the
        server honours it (probed once, see ``_require_conditional_complete``); where it does
        not (Ceph RGW 16.2), one PutObject up to ``max_put_size``. Returns the ETag of the
        object created, its identity for ``delete_if``."""
        full = self._full(key)
        views = as_buffers(data)
        size = sum(v.nbytes for v in views)
        token = secrets.token_hex(16)
        meta = {_WRITER_META: token}
        try:
            if size > self.multipart_threshold and self._multipart_conditional(key, size):
                return self._put_multipart(key, views, size, metadata=meta, if_none_match=True)
            if size > self.max_put_size:
                self._require_conditional_complete(key, size)
            resp = self._put_object_if_none_match(key, full, views, meta)
            return str(resp.get("ETag", ""))
        except PreconditionFailed:
            try:
                head = self._head(key)
            except NotFoundError:
                head = {}
            if head.get("Metadata", {}).get(_WRITER_META) == token:
                return str(head.get("ETag", ""))
            raise ExistsError(f"{self._where(key)}: exists; a create-only write never replaces it") from None

    def _multipart_conditional(self, key: str, size: int) -> bool:
        """Whether a create-only put of ``size`` bytes may be a multipart upload here. A probe
        that failed before deciding (the store refused it) is raised, not taken for a no."""
        try:
            self._require_conditional_complete(key, size)
        except StorageError:
            if self._conditional_complete is None:
                raise
            return False
        return True

    def delete_if(self, key: str, tag: object) -> bool:
        """Delete ``key`` only if its ETag is still ``tag``: a HEAD compares it (servers that
        ignore ``If-Match`` on DeleteObject, e.g. Ceph RGW 16.2, rely on that alone, leaving the
        window between the HEAD and the DELETE), then DeleteObject carries ``If-Match`` (AWS S3
        and moto refuse with 412 if the object changed in that window)."""
        if not isinstance(tag, str) or not tag:
            return False
        try:
            if self._head(key).get("ETag") != tag:
                return False
            self._call(
                "DeleteObject", key, self._client.delete_object, Bucket=self.bucket, Key=self._full(key), IfMatch=tag
            )
        except (NotFoundError, PreconditionFailed, NoSuchBucket):
            return False
        return True

    def _saw_checksum(self, resp: dict) -> None:
        """After a PUT of a body: a response that echoes its CRC32 shows the server checks it,
        so later bodies need no SHA-256 signature over http (the module's docstring). Until then
        botocore signs them (its default without TLS)."""
        if self._checksums_checked or not resp.get("ChecksumCRC32"):
            return
        self._checksums_checked = True
        s3 = self._client.meta.config.s3  # this client's own dict (new_client), read per request
        if isinstance(s3, dict) and self.endpoint_url.startswith("http:"):
            s3["payload_signing_enabled"] = False

    def _require_conditional_complete(self, key: str, size: int) -> None:
        """Raise unless the server refuses a CompleteMultipartUpload with ``If-None-Match: *``
        over an existing object. Probed once per store, on a scratch key beside the root
        (``<prefix>.ckptd-probe-<random>``, never under it, removed again): a small object, then
        a one-part upload of the same key completed with the condition. 412 means honoured; a
        success means the server overwrote the object (Ceph RGW 16.2 does), so no multipart
        upload of ours can be put-if-absent there."""
        if self._conditional_complete is None:
            probe = f"{self._prefix.rstrip('/')}.ckptd-probe-{secrets.token_hex(8)}"
            c, b = self._client, self.bucket
            self._call("PutObject", "", c.put_object, Bucket=b, Key=probe, Body=b"")
            try:
                up = self._call("CreateMultipartUpload", "", c.create_multipart_upload, Bucket=b, Key=probe)
                uid = up["UploadId"]
                try:
                    part = self._call(
                        "UploadPart", "", c.upload_part, Bucket=b, Key=probe, UploadId=uid, PartNumber=1, Body=b"x"
                    )
                    self._call(
                        "CompleteMultipartUpload",
                        "",
                        c.complete_multipart_upload,
                        Bucket=b,
                        Key=probe,
                        UploadId=uid,
                        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
                        IfNoneMatch="*",
                    )
                    self._conditional_complete = False
                except PreconditionFailed:
                    self._conditional_complete = True
                    with contextlib.suppress(StorageError):
                        self._abort(probe, uid)
                except BaseException:  # the probe itself failed (undecided): leave no upload behind
                    with contextlib.suppress(StorageError):
                        self._abort(probe, uid)
                    raise
            finally:
                with contextlib.suppress(StorageError):
                    self._call("DeleteObject", "", c.delete_object, Bucket=b, Key=probe)
        if not self._conditional_complete:
            raise StorageError(
                f"{self._where(key)}: put_if_absent of {size} bytes needs a multipart upload, and "
                f"{self.endpoint_url} ignores If-None-Match on CompleteMultipartUpload (Ceph RGW "
                f"16.2 does): it would overwrite a racing writer's object; objects up to "
                f"{self.max_put_size} bytes are safe (one PutObject)"
            )

    def _part_size_for(self, size: int) -> int:
        if size <= self.part_size * MAX_PARTS:
            return self.part_size
        return math.ceil(size / MAX_PARTS / MiB) * MiB

    def _put_multipart(
        self,
        key: str,
        views: list[memoryview],
        size: int,
        metadata: dict[str, str] | None = None,
        if_none_match: bool = False,
    ) -> str:
        full = self._full(key)
        token = (metadata or {}).get(_WRITER_META) or secrets.token_hex(16)
        meta = {**(metadata or {}), _WRITER_META: token}
        # botocore puts a CRC32 on every part unless told "when_required"
        # (AWS_REQUEST_CHECKSUM_CALCULATION); the upload must then announce it too, and the
        # parts' checksums go into CompleteMultipartUpload (copied from each part's response).
        checksum = self._client.meta.config.request_checksum_calculation != "when_required"
        # A CreateMultipartUpload whose response is lost and then retried (by botocore or by us)
        # opens a second upload; the first one's id never reaches us. Count the tries, and after
        # one that was retried abort the other uploads of this key begun since.
        tries = 0

        def create(**kwargs: Any) -> dict:
            nonlocal tries
            tries += 1
            return self._client.create_multipart_upload(**kwargs)

        try:
            resp = self._call(
                "CreateMultipartUpload",
                key,
                create,
                Bucket=self.bucket,
                Key=full,
                Metadata=meta,
                **({"ChecksumAlgorithm": "CRC32"} if checksum else {}),
            )
        except BaseException:
            if tries:
                self._abort_strays(key, keep=None)
            raise
        upload_id = resp["UploadId"]
        if tries > 1 or resp.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            self._abort_strays(key, keep=upload_id)
        part_size = self._part_size_for(size)
        ends = _cumulative(views)

        def upload(number: int, off: int, n: int) -> dict:
            # Only this part's slices are joined, when its turn comes: at most one part per
            # worker is ever copied, never the whole object.
            body = _join(_slice(views, ends, off, n))
            resp = self._call(
                "UploadPart",
                key,
                self._client.upload_part,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                **({"ChecksumAlgorithm": "CRC32"} if checksum else {}),
            )
            self._saw_checksum(resp)
            part = {"PartNumber": number, "ETag": resp["ETag"]}
            part.update({k: v for k, v in resp.items() if k.startswith("Checksum") and isinstance(v, str)})
            return part

        try:
            parts = self._submit_all(
                [
                    lambda i=i, off=off: upload(i + 1, off, min(part_size, size - off))
                    for i, off in enumerate(range(0, size, part_size))
                ]
            )
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            try:
                done = self._call(
                    "CompleteMultipartUpload",
                    key,
                    self._client.complete_multipart_upload,
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **extra,
                )
            except NoSuchUpload:
                # A retried Complete whose first try succeeded (and lost its response) finds the
                # upload gone: it succeeded if the object there carries our token.
                try:
                    ours = self._head(key).get("Metadata", {}).get(_WRITER_META) == token
                except NotFoundError:
                    ours = False
                if not ours:
                    raise
                return self._head(key).get("ETag", "")
            return str(done.get("ETag", ""))
        except BaseException:
            # Parts of an unfinished upload are stored (and billed) until aborted.
            with contextlib.suppress(StorageError):
                self._call(
                    "AbortMultipartUpload",
                    key,
                    self._client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                )
            raise

    def _uploads(self, key_prefix: str) -> Iterator[dict]:
        """Incomplete multipart uploads whose key starts with ``key_prefix`` (relative)."""

        def after(page: dict) -> dict | None:
            if not page.get("IsTruncated"):
                return None
            return {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

        for page in self._paged("ListMultipartUploads", self._client.list_multipart_uploads, key_prefix, after):
            yield from page.get("Uploads", [])

    def _abort(self, full_key: str, upload_id: str) -> bool:
        try:
            self._call(
                "AbortMultipartUpload",
                full_key[len(self._prefix) :],
                self._client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=full_key,
                UploadId=upload_id,
            )
        except NoSuchUpload:
            return False  # completed or aborted meanwhile
        return True

    def _abort_strays(self, key: str, keep: str | None) -> None:
        """Best effort: abort every incomplete upload of exactly ``key`` but ``keep``. One writer
        writes a key of a step (writers of one root are fenced), so the others are this call's
        lost-response orphans or those of a killed earlier attempt at the same step. (No time
        filter: S3's ``Initiated`` comes from the server's clock, and moto answers a fixed date.)"""
        full = self._full(key)
        try:
            for up in list(self._uploads(key)):
                if up.get("Key") == full and up.get("UploadId") != keep:
                    self._abort(full, up["UploadId"])
        except StorageError:
            pass  # gc's abort_stale_uploads catches what this misses

    def abort_stale_uploads(self, older_than: float, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        cutoff = time.time() - older_than
        aborted = []
        for up in list(self._uploads(prefix)):
            initiated = up.get("Initiated")
            if initiated is not None and initiated.timestamp() > cutoff:
                continue
            if self._abort(up["Key"], up["UploadId"]):
                aborted.append(up["Key"][len(self._prefix) :])
        return aborted

    def copy(self, src_key: str, dst_key: str) -> None:
        # Server-side CopyObject works up to 5 GiB; larger objects would need a multipart copy
        # (UploadPartCopy), which checkpoints' chunk-sized objects never need.
        self._call(
            "CopyObject",
            src_key,
            self._client.copy_object,
            Bucket=self.bucket,
            Key=self._full(dst_key),
            CopySource={"Bucket": self.bucket, "Key": self._full(src_key)},
        )

    def delete(self, key: str) -> None:
        full = self._full(key)
        with contextlib.suppress(NoSuchBucket):  # deleting a missing key is not an error
            self._call("DeleteObject", key, self._client.delete_object, Bucket=self.bucket, Key=full)

    def delete_prefix(self, prefix: str) -> int:
        return self.purge(prefix)[0]

    def purge(self, prefix: str) -> tuple[int, int]:
        """Objects under ``prefix`` (S3 has no temp files or folders to leave behind; the
        incomplete multipart uploads of killed writers are ``abort_uploads``'s).

        The listing is paged (1000 keys a page); the keys then go in DeleteObjects of at most
        1000 keys, ``delete_workers`` of them in flight at once (a 4096-rank checkpoint of 1000
        arrays is 4096 batches: sequential, that is minutes of round trips). Keys a batch
        reports as failed with a transient code (InternalError, SlowDown, ...) are sent again,
        up to the store's tries; any other code, or keys still failing after them, fail the
        purge with one StorageError naming a key and how many are left (after every batch has
        been tried: the rest are deleted)."""
        check_prefix(prefix)
        infos = list(self._list(prefix))
        keys = [info.key for info in infos]
        batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
        workers = min(self.delete_workers, len(batches))
        if workers <= 1:
            for batch in batches:
                self._delete_batch(prefix, batch)
        else:
            # A pool of its own: purge may run on the store's pool, which must never wait on itself.
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-s3-delete") as pool:
                futures = [pool.submit(self._delete_batch, prefix, batch) for batch in batches]
                errors = [e for e in (f.exception() for f in futures) if e is not None]
            if errors:
                raise errors[0]
        return len(keys), sum(info.size for info in infos)

    def _delete_batch(self, prefix: str, batch: list[str]) -> None:
        """One DeleteObjects of ``batch`` (relative keys), then again for the keys it reported
        as failed with a transient code, with the Caller's tries and backoff."""
        left = batch
        for attempt in range(1, self._caller.attempts + 1):
            resp = self._call(
                "DeleteObjects",
                prefix,
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._prefix + k} for k in left], "Quiet": True},
            )
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if not errors:
                return
            final = [e for e in errors if e.get("Code") not in RETRY_CODES]
            if final or attempt == self._caller.attempts:
                e = (final or errors)[0]
                after = f" after {attempt} attempts" if attempt > 1 else ""
                raise StorageError(
                    f"s3://{self.bucket}/{e.get('Key')}: DeleteObjects failed: {e.get('Code')}: "
                    f"{e.get('Message')} ({len(errors)} of {len(batch)} keys not deleted{after})"
                )
            n = len(self._prefix)
            left = [str(e.get("Key", ""))[n:] for e in errors]
            time.sleep(random.uniform(0, min(10.0, self._caller.backoff * 2 ** (attempt - 1))))

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._client.close()
