"""The S3 store's listings and deletes: paged ListObjectsV2, plain DeleteObject, and ``purge``.

Invariants: a missing bucket is an empty store (listings yield nothing, deletes succeed);
folder markers other tools leave (keys ending in ``/``) are never listed as objects; ``purge``
deletes in DeleteObjects of at most ``DELETE_BATCH`` keys from a pool of its own (it may run on
the store's pool, which must never wait on itself), resends only the keys a batch reports as
failed with a transient code, and fails with one StorageError only after every batch was tried.

``Listing`` is a mixin of ``S3Store`` (``storage_backends.s3``) and uses its helpers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from storage_backends._s3_calls import RETRY_CODES, NoSuchBucket
from storage_backends.base import NotFoundError, ObjectInfo, StorageError, check_dir_prefix, check_prefix

__all__ = ["DELETE_BATCH", "Listing"]

DELETE_BATCH = 1000  # S3's most keys per DeleteObjects


class Listing:
    """ListObjectsV2 and DeleteObject(s) verbs of ``S3Store``."""

    def _paged(
        self, op: str, fn: Callable[..., dict], key_prefix: str, after: Callable[[dict], dict | None], **kwargs: Any
    ) -> Iterator[dict]:
        """Every page of the listing ``op`` of keys starting with ``key_prefix`` (relative);
        ``after(page)`` gives the markers of the page after ``page``, None after the last one. A
        missing root is an empty store."""
        markers: dict | None = {}
        while markers is not None:
            try:
                page = self._call(
                    op, key_prefix, fn, Bucket=self.bucket, Prefix=self._prefix + key_prefix, **kwargs, **markers
                )
            except NoSuchBucket:
                return
            yield page
            markers = after(page)

    def _pages(self, key_prefix: str, **kwargs: Any) -> Iterator[dict]:
        def after(page: dict) -> dict | None:
            token = page.get("NextContinuationToken")
            return {"ContinuationToken": token} if page.get("IsTruncated") and token else None

        return self._paged("ListObjectsV2", self._client.list_objects_v2, key_prefix, after, **kwargs)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._list(check_prefix(prefix))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        strip = len(self._prefix)
        for page in self._pages(prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"][strip:]
                if key and not key.endswith("/"):  # skip "folder markers" other tools make
                    yield ObjectInfo(key, obj["Size"], obj["LastModified"].timestamp())

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return self.list_dir_after(prefix, "")

    def list_dir_after(self, prefix: str, after: str) -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        strip = len(self._prefix) + len(prefix)
        names, folders = [], []
        start = {"StartAfter": self._prefix + prefix + after} if after else {}
        for page in self._pages(prefix, Delimiter="/", **start):
            names += [o["Key"][strip:] for o in page.get("Contents", []) if o["Key"][strip:] > after]
            folders += [p["Prefix"][strip:].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names), sorted(f for f in folders if f > after)

    def exists_root(self) -> bool:
        try:
            self._call("HeadBucket", "", self._client.head_bucket, Bucket=self.bucket)
        except NotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        full = self._full(key)
        with contextlib.suppress(NoSuchBucket):  # deleting a missing key is not an error
            self._call("DeleteObject", key, self._client.delete_object, Bucket=self.bucket, Key=full)

    def purge(self, prefix: str) -> tuple[int, int]:
        """Objects under ``prefix`` (S3 has no temp files or folders to leave behind; the
        incomplete multipart uploads of killed writers are ``abort_stale_uploads``'s), in
        batches, ``delete_workers`` of them in flight at once (a 4096-rank checkpoint of 1000
        arrays is 4096 batches: sequential, that is minutes of round trips). A failure names a
        key and how many are left."""
        infos = list(self.list(prefix))
        keys = [info.key for info in infos]
        batches = [keys[i : i + DELETE_BATCH] for i in range(0, len(keys), DELETE_BATCH)]
        workers = max(1, min(self.delete_workers, len(batches)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-s3-delete") as pool:
            futures = [pool.submit(self._delete_batch, prefix, batch) for batch in batches]
            errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]
        return len(keys), sum(info.size for info in infos)

    def _delete_batch(self, prefix: str, batch: list[str]) -> None:
        """One DeleteObjects of ``batch`` (relative keys), then again for the keys it reported
        as failed with a transient code: ``retries + 1`` rounds, with the Caller's backoff."""
        left = batch
        for attempt in range(1, self._rounds + 1):
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
            if final or attempt == self._rounds:
                e = (final or errors)[0]
                after = f" after {attempt} attempts" if attempt > 1 else ""
                raise StorageError(
                    f"s3://{self.bucket}/{e.get('Key')}: DeleteObjects failed: {e.get('Code')}: "
                    f"{e.get('Message')} ({len(errors)} of {len(batch)} keys not deleted{after})"
                )
            left = [str(e.get("Key", ""))[len(self._prefix) :] for e in errors]
            self._caller.pause(attempt)
