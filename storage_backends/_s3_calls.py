"""Making one S3 call: a botocore client, our retry loop, and errors as StorageError.

botocore retries each request itself ("standard" mode) unless the store is paced (then every try
is ``Caller``'s, ``storage_backends.s3_retry``). ``Caller`` retries the whole call (request *and*
reading the response body, which botocore does not retry) with exponential backoff and full
jitter on throttling (SlowDown, 503), other 5xx and broken connections, and turns every other
failure into a one-line StorageError naming the s3:// URI.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError, SSLError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.loaders import Loader, create_loader
from urllib3.exceptions import HTTPError as Urllib3Error

from storage_backends.base import NotFoundError, StorageError

T = TypeVar("T")

# Error codes worth another try: throttling, server trouble, and the 409 S3 returns when two
# conditional writes of one key race (retrying turns it into a clean 412 or success).
RETRY_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
}
RETRY_STATUS = {429, 500, 502, 503, 504}
NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
# For these a missing bucket is an empty store (NoSuchBucket, a NotFoundError); writes just fail.
EMPTY_IF_NO_BUCKET = {"GetObject", "HeadObject", "ListObjectsV2", "HeadBucket", "DeleteObject"}


class PreconditionFailed(StorageError):
    """412: an If-None-Match or If-Match condition did not hold."""


class InvalidRange(StorageError):
    """416: the range starts past the end of the object."""


class NoSuchBucket(NotFoundError):
    pass


class NoSuchUpload(StorageError):
    pass


class Truncated(Exception):
    """A response body ended early; retried like a broken connection."""


# A broken connection, whoever notices it: botocore wraps most of these, but an error response
# whose body is cut (a 404 to a GetObject, read while botocore parses it) reaches us as a raw
# urllib3 ``ProtocolError``, and a socket error while streaming a body as an ``OSError``.
_TRANSIENT = (
    BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    Truncated,
    Urllib3Error,
    http.client.HTTPException,
    OSError,
)


def _transient(e: Exception) -> bool:
    """Worth another try: throttling, server trouble, a broken connection; not certificate
    trouble (it does not heal by retrying), missing credentials, bad parameters, ..."""
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return e.response.get("Error", {}).get("Code") in RETRY_CODES or status in RETRY_STATUS
    return isinstance(e, _TRANSIENT) and not isinstance(e, SSLError)


def env_size(name: str, default: int, given: int | None = None) -> int:
    """``given`` unless None, else a byte count from the environment: ``16777216``, ``16M`` or
    ``16MiB`` (binary units)."""
    if given is not None:
        return given
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", raw, re.IGNORECASE)
    if not m:
        raise ValueError(f"{name}={raw!r}: expected a byte count such as 16777216 or 16MiB")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def env_number(name: str, default: float, given: float | None = None) -> float:
    """``given`` unless None, else a non-negative number from the environment (timeouts, attempt
    counts)."""
    if given is not None:
        return given
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{name}={raw!r}: expected a non-negative number")
    return value


_loader: Loader | None = None
_loader_lock = threading.Lock()


def new_client(region: str | None, endpoint_url: str | None, config: Config) -> Any:
    """A botocore S3 client (what ``boto3.client("s3")`` returns) from a fresh session, so that
    credentials, profile and endpoint are resolved from the environment as it is now, sharing
    one loader of service models: parsing the S3 model again costs ~0.1 s per store."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = create_loader()
        session = botocore.session.Session()
        session.register_component("data_loader", _loader)
        # S3Store._saw_checksum turns payload signing off in this copy once the server showed it
        # checks our CRC32s (storage_backends.s3's docstring).
        config = config.merge(Config(s3=dict(config.s3 or {})))  # the store's own, mutable copy
        return session.create_client("s3", region_name=region, endpoint_url=endpoint_url, config=config)


class Caller:
    """Runs calls with retries for one store; ``where`` in messages is an s3:// URI."""

    def __init__(self, bucket: str, endpoint_url: str, attempts: int, backoff: float) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.attempts = max(1, attempts)
        self.backoff = backoff

    def __call__(self, op: str, where: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """``fn(**kwargs)``, retried; failures become StorageError (or a subclass above)."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn(**kwargs)
            except (ClientError, BotoCoreError, *_TRANSIENT) as e:
                if attempt == self.attempts or not _transient(e):
                    raise self.error(op, where, e, attempt) from None
            self.pause(attempt)
        raise AssertionError("unreachable")

    def pause(self, attempt: int) -> None:
        """The backoff after try ``attempt``: full jitter, capped at 10 s."""
        time.sleep(random.uniform(0, min(10.0, self.backoff * 2 ** (attempt - 1))))

    def error(self, op: str, where: str, e: Exception, attempts: int) -> StorageError:
        after = f" after {attempts} attempts" if attempts > 1 else ""
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", "Unknown"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code}: {err['Message']}" if err.get("Message") else code
            text = " ".join(f"{where}: {op} failed: {detail} (HTTP {status}){after}".split())
            if code == "NoSuchBucket":
                text = f"{where}: {op} failed: no bucket {self.bucket!r} at {self.endpoint_url}"
                return NoSuchBucket(text) if op in EMPTY_IF_NO_BUCKET else StorageError(text)
            if code in NOT_FOUND_CODES:
                return NotFoundError(f"{where}: no such object")
            if code == "NoSuchUpload":
                return NoSuchUpload(text)
            if code == "PreconditionFailed" or status == 412:
                return PreconditionFailed(text)
            if code == "InvalidRange" or status == 416:
                return InvalidRange(text)
            return StorageError(text)
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return StorageError(" ".join(f"{where}: {op} failed{after} (endpoint {self.endpoint_url}): {detail}".split()))
