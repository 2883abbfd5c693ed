"""The S3 store's conditional verbs: ``put_if_absent``, ``put_new`` (If-None-Match) and
``delete_if`` (If-Match), with the fallbacks for servers that honour only part of them.

Invariants: a create-only write never replaces an object: it is one PutObject with
``If-None-Match: *``, or a multipart upload whose Complete carries the condition only after a
once-per-store probe showed the server refuses such a Complete over an existing object (Ceph RGW
16.2 overwrites instead). A 412 is our own win exactly when the object there carries this call's
token (``_tokened``). ``delete_if`` deletes only the object whose ETag it was given.

``ConditionalWrites`` is a mixin of ``S3Store`` (``storage_backends.s3``) and uses its helpers;
the probe's answer is kept in the store's ``_conditional_complete``.
"""

from __future__ import annotations

import contextlib
import secrets

from storage_backends._s3_calls import NoSuchBucket, PreconditionFailed
from storage_backends._s3_multipart import WRITER_META
from storage_backends.base import Data, ExistsError, NotFoundError, StorageError, as_buffers, check_key

__all__ = ["ConditionalWrites"]


class ConditionalWrites:
    """If-None-Match / If-Match verbs of ``S3Store``."""

    def put_if_absent(self, key: str, data: Data) -> bool:
        views, size, meta = self._tokened(key, data)
        try:
            # One PutObject even above the multipart threshold: its If-None-Match is honoured
            # everywhere, CompleteMultipartUpload's is not (Ceph RGW 16.2 overwrites).
            if size <= self.max_put_size:
                self._put_object(key, views, IfNoneMatch="*", Metadata=meta)
            else:
                if self.exists(key):  # don't upload gigabytes only to lose
                    return False
                self._require_conditional_complete(key, size)
                self._put_multipart(key, views, size, metadata=meta, if_none_match=True)
        except PreconditionFailed:
            return self._ours(key, meta[WRITER_META]) is not None
        return True

    def put_new(self, key: str, data: Data) -> str:
        """Create-only: PutObject with ``If-None-Match: *`` (a 412 is ExistsError unless the object
        there carries this call's token, see ``_tokened``). Above the multipart threshold, a
        multipart upload whose Complete carries the condition where the server honours it
        (``_require_conditional_complete``), else (Ceph RGW 16.2) one PutObject up to
        ``max_put_size``. Returns the ETag of the object created, its identity for ``delete_if``."""
        views, size, meta = self._tokened(key, data)
        try:
            if size > self.multipart_threshold and self._multipart_conditional(key, size):
                return self._put_multipart(key, views, size, metadata=meta, if_none_match=True)
            if size > self.max_put_size:
                self._require_conditional_complete(key, size)
            resp = self._put_object(key, views, IfNoneMatch="*", Metadata=meta)
            return str(resp.get("ETag", ""))
        except PreconditionFailed:
            head = self._ours(key, meta[WRITER_META])
            if head is not None:
                return str(head.get("ETag", ""))
            raise ExistsError(f"{self._where(key)}: exists; a create-only write never replaces it") from None

    @staticmethod
    def _tokened(key: str, data: Data) -> tuple[list[memoryview], int, dict[str, str]]:
        """(views, size, metadata) of a conditional write: the key checked first, and a new
        writer token in the metadata. On a 412 the token tells whether the object there is
        ours: when a response is lost and the PUT retried (by botocore or by us), the retry
        meets the object the first try wrote, and that call still won."""
        check_key(key)
        views = as_buffers(data)
        return views, sum(v.nbytes for v in views), {WRITER_META: secrets.token_hex(16)}

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
                except BaseException as e:
                    with contextlib.suppress(StorageError):  # leave no upload behind
                        self._abort(probe, uid)
                    if not isinstance(e, PreconditionFailed):
                        raise  # the probe itself failed: undecided
                    self._conditional_complete = True
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
