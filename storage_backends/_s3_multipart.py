"""The S3 store's multipart uploads: parallel parts, and aborting the uploads left behind.

Invariants: an upload that fails is aborted (its parts are stored and billed until then); a
CreateMultipartUpload that was retried may have opened an upload whose id never reached us, so
the other uploads of that key are aborted (one writer writes a key of a step); a retried
Complete that finds the upload gone succeeded exactly when the object carries our token
(``WRITER_META``); only one part per worker is ever joined into a copy.

``Multipart`` is a mixin of ``S3Store`` (``storage_backends.s3``) and uses its helpers.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Iterator
from typing import Any

from storage_backends._s3_buffers import MiB, cumulative, join, slice_views
from storage_backends._s3_calls import NoSuchUpload
from storage_backends.base import NotFoundError, StorageError, check_prefix

__all__ = ["MAX_PARTS", "WRITER_META", "Multipart"]

MAX_PARTS = 10_000  # S3's maximum parts per upload

WRITER_META = "ckptd-writer"  # user metadata naming the put_if_absent call that wrote an object


class Multipart:
    """CreateMultipartUpload ... CompleteMultipartUpload, and AbortMultipartUpload."""

    def _put_multipart(
        self,
        key: str,
        views: list[memoryview],
        size: int,
        metadata: dict[str, str] | None = None,
        if_none_match: bool = False,
    ) -> str:
        full = self._full(key)
        token = (metadata or {}).get(WRITER_META) or secrets.token_hex(16)
        meta = {**(metadata or {}), WRITER_META: token}
        # botocore puts a CRC32 on every part unless told "when_required"
        # (AWS_REQUEST_CHECKSUM_CALCULATION); the upload must then announce it too, and the
        # parts' checksums go into CompleteMultipartUpload (copied from each part's response).
        checksum = self._client.meta.config.request_checksum_calculation != "when_required"
        tries = 0  # CreateMultipartUpload's: after a retried one, abort the key's other uploads

        def create(**kwargs: Any) -> dict:
            nonlocal tries
            tries += 1
            return self._client.create_multipart_upload(**kwargs)

        algorithm = {"ChecksumAlgorithm": "CRC32"} if checksum else {}
        try:
            resp = self._call(
                "CreateMultipartUpload", key, create, Bucket=self.bucket, Key=full, Metadata=meta, **algorithm
            )
        except BaseException:
            if tries:
                self._abort_strays(key, keep=None)
            raise
        upload_id = resp["UploadId"]
        if tries > 1 or resp.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            self._abort_strays(key, keep=upload_id)
        part_size = self.part_size if size <= self.part_size * MAX_PARTS else math.ceil(size / MAX_PARTS / MiB) * MiB
        ends = cumulative(views)

        def upload(number: int, off: int, n: int) -> dict:
            body = join(slice_views(views, ends, off, n))  # only this part's slices, in its turn
            resp = self._call(
                "UploadPart",
                key,
                self._client.upload_part,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                **algorithm,
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
                head = self._ours(key, token)
                if head is None:
                    raise
                return head.get("ETag", "")
            return str(done.get("ETag", ""))
        except BaseException:
            with contextlib.suppress(StorageError):
                self._abort(full, upload_id)
            raise

    def _ours(self, key: str, token: str) -> dict | None:
        """The object's HeadObject if it carries the writer token ``token`` (``WRITER_META``),
        else None (someone else's, or gone)."""
        try:
            head = self._head(key)
        except NotFoundError:
            return None
        return head if head.get("Metadata", {}).get(WRITER_META) == token else None

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
        with contextlib.suppress(StorageError):  # gc's abort_stale_uploads catches what this misses
            for up in list(self._uploads(key)):
                if up.get("Key") == full and up.get("UploadId") != keep:
                    self._abort(full, up["UploadId"])

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
