"""Issue 27 item 12: a response cut mid-way by the network must reach the caller as a
``StorageError`` naming the operation (retried where safe), never as a raw urllib3 or botocore
exception. The cut comes from the fault proxy in front of a real moto server."""

from __future__ import annotations

import pytest

from storage_backends import NotFoundError, StorageError
from storage_backends.s3 import S3Store
from tests.doubles.faults import FaultPlan, FaultProxy, Rule

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def _store(bucket_uri: str, url: str, attempts: int) -> S3Store:
    bucket, _, prefix = bucket_uri[len("s3://") :].partition("/")
    # retries=0: ``attempts`` tries in all, so a call cut every time fails after them, not after
    # attempts x 5 tries with backoff (44 s of CI for two calls)
    return S3Store(bucket, prefix, endpoint_url=url, max_attempts=attempts, retries=0)


@pytest.mark.parametrize("attempts", [1, 4])
def test_a_cut_error_response_is_a_storage_error(s3_bucket, s3_server, attempts):
    """Every GetObject of a missing key has its 404 answer cut in half: with one attempt the
    caller gets a StorageError naming GetObject; with retries the cut is retried and the later,
    whole answer is a NotFoundError."""
    rules = [Rule(lambda r: r.op == "GetObject", "cut", times=1 if attempts > 1 else 1000)]
    with FaultProxy(s3_server, FaultPlan(rules=rules)) as proxy:
        store = _store(s3_bucket, proxy.url, attempts)
        try:
            if attempts == 1:
                with pytest.raises(StorageError, match="GetObject") as got:
                    store.get("missing")
                assert not isinstance(got.value, NotFoundError)
            else:
                with pytest.raises(NotFoundError):
                    store.get("missing")
            assert proxy.counters["fault:cut:GetObject"] >= 1
        finally:
            store.close()


def test_a_cut_ranged_read_of_a_missing_key_is_a_storage_error(s3_bucket, s3_server):
    rules = [Rule(lambda r: r.op in ("GetObject", "HeadObject"), "cut", times=1000)]
    with FaultProxy(s3_server, FaultPlan(rules=rules)) as proxy:
        store = _store(s3_bucket, proxy.url, 2)
        try:
            for call in (lambda: store.get_range("missing", 0, 4), lambda: store.head("missing")):
                with pytest.raises(StorageError):
                    call()
        finally:
            store.close()
