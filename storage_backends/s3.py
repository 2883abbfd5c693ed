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
parallel ranged GETs; up to the multipart threshold an object is one PUT and a range one GET.
Tuning: ``CKPTD_S3_PART_SIZE`` (default 16 MiB), ``CKPTD_S3_MULTIPART_THRESHOLD`` (default two
parts) (bytes, or with a binary K/M/G suffix), ``CKPTD_S3_WORKERS``, or the constructor's arguments.

Integrity: every PUT carries botocore's CRC32 of its body (unless
``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``), and every chunk its crc32c. Over http the
body is also SHA-256 signed until a response echoes the CRC32 (``x-amz-checksum-crc32``), which
shows the server checks it (AWS, MinIO): signing then stops, saving a hash of every byte without
TLS. Ceph RGW 16.2 neither echoes nor checks it (docs/s3.md), so there bodies stay signed. Over
https botocore never signs payloads that carry a checksum.

Retries: by default adaptive pacing (``s3_retry``): after a SlowDown in a scope (one step's
objects) every thread of the store sends fewer requests per second there, and a paced store
makes all of a call's ``max_attempts x (retries + 1)`` tries itself (``_s3_calls.Caller``), so
no retry quota of botocore's can cut them short. ``CKPTD_S3_RETRY_MODE=standard`` turns pacing
off and leaves each try of ours to botocore's "standard" retries.

``put_if_absent`` needs ``If-None-Match: *`` on PutObject, which AWS S3 (since 2024-08), MinIO,
Ceph RGW 16.2 and moto honour with 412. It is one PutObject up to S3's single-PUT limit of 5 GiB
(``max_put_size``), never a multipart upload: Ceph RGW 16.2 ignores If-None-Match on
CompleteMultipartUpload and overwrites, so every racing writer would win (``_s3_conditional``
probes for that before it uploads more than the limit; docs/s3.md). (moto tests and writes
without a lock, so racing writers could both win there; real S3 rules that out.) A store that
ignores the header on PutObject too would make every writer win; don't point ckptd at one.
A missing bucket is an empty store for reads, but puts do not create buckets (that needs
permissions and a region choice that belong to the operator): they fail with NoSuchBucket.

Here: the client, its configuration and plain ``put``; the other verbs are mixins, each module
with its invariants (``_s3_reads``, ``_s3_listing``, ``_s3_conditional``, ``_s3_multipart``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from botocore.config import Config
from botocore.utils import determine_content_length

from storage_backends._s3_buffers import MiB, join
from storage_backends._s3_calls import Caller, env_number, env_size, new_client
from storage_backends._s3_conditional import ConditionalWrites
from storage_backends._s3_listing import Listing
from storage_backends._s3_multipart import MAX_PARTS, Multipart
from storage_backends._s3_reads import Reads
from storage_backends.base import Data, Store, as_buffers, check_key, check_prefix
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

DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_WORKERS = 16
DEFAULT_DELETE_WORKERS = 4  # DeleteObjects in flight at once in ``purge``
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PUT_SIZE = 5 << 30  # S3's maximum for one PutObject
SMALL_BODY = 1 * MiB  # PUT bodies below this go without waiting for 100-continue
T = TypeVar("T")


def _no_wait_for_small_bodies(params: dict, **_: Any) -> None:
    """botocore sends every PUT body with ``Expect: 100-continue`` and waits for the server's
    go-ahead before the body: one more round trip per request. It lets the server refuse a large
    body before it travels (a 412, a redirect); a body under ``SMALL_BODY`` (each zarr.json, a
    small tensor's chunk) costs less to send than that wait, so it goes at once. (``Expect`` is
    not signed.)"""
    n = determine_content_length(params.get("body"))
    if n is not None and n < SMALL_BODY:
        params.get("headers", {}).pop("Expect", None)


class S3Store(Reads, Listing, ConditionalWrites, Multipart, Store):
    """``s3://bucket/prefix``.

    Thread-safe: every method may be called from many threads; they share one client (whose
    connection pool is sized for the thread pool plus callers) and one thread pool. Calls made
    from inside that pool never wait on it, so it cannot deadlock.

    ``put`` is atomic as S3 is (a GET sees the old or the new object); a read in several ranged
    pieces never stitches two versions together (``_s3_reads``).
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
        """A call gets ``max_attempts x (retries + 1)`` tries: ``max_attempts`` of botocore's
        within each of ours (paced: all of them ours), sleeping up to ``backoff * 2**n`` seconds
        between ours (full jitter, capped at 10 s).

        Every call has a deadline: ``connect_timeout`` to connect and ``read_timeout`` for each
        wait on the server, per attempt; so a call to an endpoint that stops answering fails
        after about ``max_attempts * (retries + 1) * read_timeout`` seconds. Unset, they come
        from ``CKPTD_S3_CONNECT_TIMEOUT`` (10), ``CKPTD_S3_READ_TIMEOUT`` (60),
        ``CKPTD_S3_MAX_ATTEMPTS`` (8) and ``CKPTD_S3_RETRIES`` (4). A save as a whole is also
        bounded by ``Checkpointer(save_timeout=...)``.

        ``max_put_size``: the largest object ``put_if_absent`` sends as one conditional PutObject
        (the server's single-PUT limit; see the module's docstring).

        ``retry_mode``: ``"adaptive"`` (default; ``CKPTD_S3_RETRY_MODE``) paces the store after
        throttling, at no less than ``min_rate`` requests/s per scope (``CKPTD_S3_MIN_RATE``, 0.2);
        ``"standard"`` only retries. ``delete_workers``: DeleteObjects in flight at once in
        ``purge`` (``CKPTD_S3_DELETE_WORKERS``, 4)."""
        max_attempts = int(env_number("CKPTD_S3_MAX_ATTEMPTS", 8, max_attempts))
        retries = int(env_number("CKPTD_S3_RETRIES", 4, retries))
        connect_timeout = env_number("CKPTD_S3_CONNECT_TIMEOUT", 10.0, connect_timeout)
        read_timeout = env_number("CKPTD_S3_READ_TIMEOUT", 60.0, read_timeout)
        if retry_mode is None:
            retry_mode = os.environ.get("CKPTD_S3_RETRY_MODE", "").strip() or "adaptive"
        if retry_mode not in ("adaptive", "standard"):
            raise ValueError(f"S3 retry mode {retry_mode!r}: expected 'adaptive' or 'standard'")
        min_rate = env_number("CKPTD_S3_MIN_RATE", DEFAULT_MIN_RATE, min_rate)
        self.delete_workers = max(1, int(env_number("CKPTD_S3_DELETE_WORKERS", DEFAULT_DELETE_WORKERS, delete_workers)))
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        prefix = check_prefix(prefix.strip("/"))
        self.bucket = bucket
        self._prefix = prefix + "/" if prefix else ""
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

        part_size = env_size("CKPTD_S3_PART_SIZE", DEFAULT_PART_SIZE, part_size)
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 part size {part_size} is below S3's minimum of {MIN_PART_SIZE} bytes")
        self.part_size = part_size
        # Up to two parts' worth goes as one PUT: an object a little over one part would
        # otherwise become four requests (create, two parts, complete) for one part of data.
        self.multipart_threshold = env_size("CKPTD_S3_MULTIPART_THRESHOLD", 2 * part_size, multipart_threshold)
        workers = max_workers or int(os.environ.get("CKPTD_S3_WORKERS") or DEFAULT_WORKERS)

        # With a custom endpoint (MinIO, Ceph, moto) use path-style addressing: virtual hosts
        # like bucket.localhost rarely resolve there; AWS accepts both.
        paced = retry_mode == "adaptive"
        custom_endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            # Pool workers plus caller threads each hold a connection; botocore's default of 10
            # would make them queue (and log "connection pool is full").
            max_pool_connections=workers + 16,
            # total_max_attempts counts the first try; botocore's "max_attempts" would not. A
            # paced store makes every try itself (the module's docstring says why).
            retries={"mode": "standard", "total_max_attempts": 1 if paced else max(1, max_attempts)},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            tcp_keepalive=True,
            s3={"addressing_style": "path"} if custom_endpoint else None,
        )
        self._client = new_client(region or os.environ.get("AWS_REGION") or None, endpoint_url, config)
        self.endpoint_url: str = self._client.meta.endpoint_url
        tries = (retries + 1) * (max(1, max_attempts) if paced else 1)
        self._caller = Caller(bucket, self.endpoint_url, tries, backoff)
        self._rounds = retries + 1  # purge's DeleteObjects of the keys a batch reported failed
        self.limiter = AdaptiveLimiter(min_rate) if paced else None
        self._pacer = Pacer(self.limiter) if self.limiter else None
        if self._pacer:
            self._pacer.attach(self._client.meta.events)
        self._client.meta.events.register_last("before-call.s3", _no_wait_for_small_bodies)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-s3")
        self.max_put_size = max_put_size
        self._checksums_checked = False  # the server showed it checks our CRC32s
        self._conditional_complete: bool | None = None  # the probe's answer, once known

    # -- plumbing ---------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._prefix}{key}"

    def _call(self, op: str, key: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
        with self._pacer.scoped(key) if self._pacer else contextlib.nullcontext():
            return self._caller(op, self._where(key) if key else self.uri, fn, **kwargs)

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

    # -- writes (reads: _s3_reads; listings, deletes: _s3_listing; conditional verbs:
    # _s3_conditional; multipart uploads: _s3_multipart) -------------------------------------------

    def put(self, key: str, data: Data) -> None:
        check_key(key)
        views = as_buffers(data)
        size = sum(v.nbytes for v in views)
        if size <= self.multipart_threshold:
            self._put_object(key, views)
        else:
            self._put_multipart(key, views, size)

    def _put_object(self, key: str, views: list[memoryview], **conditions: Any) -> dict:
        """One PutObject of ``views`` (joined without a copy where they are one ``bytes``);
        ``conditions`` are extra PutObject arguments (IfNoneMatch, Metadata)."""
        resp = self._call(
            "PutObject",
            key,
            self._client.put_object,
            Bucket=self.bucket,
            Key=self._full(key),
            Body=join(views),
            **conditions,
        )
        self._saw_checksum(resp)
        return resp

    def _saw_checksum(self, resp: dict) -> None:
        """After a PUT: a response that echoes its CRC32 shows the server checks it, so later
        bodies need no SHA-256 signature over http (the module's docstring)."""
        if self._checksums_checked or not resp.get("ChecksumCRC32"):
            return
        self._checksums_checked = True
        s3 = self._client.meta.config.s3  # this client's own dict (new_client), read per request
        if isinstance(s3, dict) and self.endpoint_url.startswith("http:"):
            s3["payload_signing_enabled"] = False

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

    def close(self) -> None:  # both steps may run again: a second close does nothing
        self._pool.shutdown(wait=True)
        self._client.close()
