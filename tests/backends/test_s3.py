"""S3Store against moto's standalone server on loopback (see tests/s3server.py).

Faults are real too: a closed port, and a small HTTP proxy in front of the server that answers
503 SlowDown or drops the connection for the next N requests.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from storage_backends import StorageError, open_store
from storage_backends.s3 import MIN_PART_SIZE, S3Store
from storage_backends.testing import StoreConformance, assert_empty_store
from tests.conftest import S3Target

pytestmark = pytest.mark.s3

MiB = 1 << 20


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def small_parts(uri: str, **kwargs) -> S3Store:
    """A store whose multipart threshold and part size are S3's minimum, 5 MiB."""
    bucket, prefix = _split(uri)
    kwargs = {"part_size": MIN_PART_SIZE, "multipart_threshold": MIN_PART_SIZE, "max_workers": 4, **kwargs}
    return S3Store(bucket, prefix, **kwargs)


class TestS3Store(StoreConformance):
    large_size = 12 * MiB + 12345  # three 5 MiB parts

    @pytest.fixture
    def store(self, s3_bucket: str) -> Iterator[S3Store]:
        with small_parts(s3_bucket) as s:
            yield s


class TestRGWStore(StoreConformance):
    """The same suite against Ceph's RADOS Gateway (tests/rgwserver.py)."""

    large_size = 12 * MiB + 12345

    @pytest.fixture
    def store(self, rgw_bucket: str) -> Iterator[S3Store]:
        with small_parts(rgw_bucket) as s:
            yield s


def test_open_store_reads_the_standard_variables(s3_target: S3Target) -> None:
    with open_store(s3_target.root) as store:
        assert isinstance(store, S3Store)
        assert store.uri == s3_target.root
        assert store.endpoint_url == s3_target.url  # from AWS_ENDPOINT_URL, read by botocore
        assert store.exists_root()
        store.put("k", b"v")
    with open_store(s3_target.root + "/") as again:
        assert again.get("k") == b"v"


def test_region_and_tuning_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("CKPTD_S3_PART_SIZE", "6MiB")
    with S3Store("some-bucket", endpoint_url="http://127.0.0.1:9") as store:
        assert store._client.meta.region_name == "eu-west-3"
        assert store.part_size == 6 * MiB
        assert store.multipart_threshold == 12 * MiB  # two parts go as one PUT
    monkeypatch.setenv("CKPTD_S3_PART_SIZE", "1MiB")
    with pytest.raises(ValueError, match="minimum"):
        S3Store("some-bucket", endpoint_url="http://127.0.0.1:9")
    monkeypatch.setenv("CKPTD_S3_PART_SIZE", "lots")
    with pytest.raises(ValueError, match="CKPTD_S3_PART_SIZE"):
        S3Store("some-bucket", endpoint_url="http://127.0.0.1:9")


def test_multipart_above_threshold(s3_target: S3Target) -> None:
    s3_bucket, client = s3_target.root, s3_target.client()
    bucket, prefix = _split(s3_bucket)
    data = os.urandom(11 * MiB)
    with small_parts(s3_bucket) as store:
        store.put("ckpt/shard", [data[:100], memoryview(data)[100:]])
        store.put("ckpt/small", data[: 5 * MiB])  # at the threshold: a single PutObject
        assert store.get("ckpt/shard") == data
    assert client.head_object(Bucket=bucket, Key=f"{prefix}/ckpt/shard")["ETag"].strip('"').endswith("-3")
    assert "-" not in client.head_object(Bucket=bucket, Key=f"{prefix}/ckpt/small")["ETag"]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_multipart_put_if_absent(s3_target: S3Target) -> None:
    s3_bucket = s3_target.root
    data = os.urandom(6 * MiB)
    with small_parts(s3_bucket) as store:
        assert store.put_if_absent("big/commit", data) is True
        assert store.put_if_absent("big/commit", b"other") is False
        assert store.get("big/commit") == data


def test_failed_multipart_upload_is_aborted(s3_target: S3Target) -> None:
    s3_bucket, client = s3_target.root, s3_target.client()
    bucket, _ = _split(s3_bucket)
    with small_parts(s3_bucket) as store:
        # Parts below S3's 5 MiB minimum make the server refuse CompleteMultipartUpload
        # (EntityTooSmall): a real server-side failure after parts were uploaded.
        store.part_size = 1 * MiB
        with pytest.raises(StorageError) as e:
            store.put("doomed", os.urandom(6 * MiB))
        assert "EntityTooSmall" in str(e.value) and "doomed" in str(e.value)
        assert not store.exists("doomed")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_missing_bucket_is_an_empty_store(s3_target: S3Target) -> None:
    with S3Store("ckptd-no-such-bucket", "job") as store:
        assert_empty_store(store)
        with pytest.raises(StorageError, match="ckptd-no-such-bucket"):
            store.put("k", b"v")


def test_unreachable_endpoint_fails_fast_naming_it() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    with S3Store("bucket", "job", endpoint_url=endpoint, max_attempts=1, retries=2, backoff=0.01) as store:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            store.get("some/key")
        assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert endpoint in msg and "s3://bucket/job/some/key" in msg and "after 3 attempts" in msg
    assert "\n" not in msg


class FlakyProxy:
    """An HTTP proxy in front of the S3 server that fails the next ``faults`` requests, with a
    503 SlowDown (``mode="slowdown"``), by closing the connection unanswered (``"drop"``), or
    by flipping a bit of the request's body on its way (``"corrupt"``; bodiless ones pass)."""

    def __init__(self, upstream: str) -> None:
        up = urlsplit(upstream)
        self.faults = 0
        self.mode = "slowdown"
        self.failed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" at once
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    fail = proxy.faults > 0
                    if fail:
                        proxy.faults -= 1
                        proxy.failed += 1
                if fail and proxy.mode == "corrupt" and body:  # one bit flipped in flight
                    body = bytes([body[0] ^ 1]) + body[1:]
                    fail = False
                if fail and proxy.mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fail:
                    xml = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    resp = conn.getresponse()
                    payload = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", resp.getheader("Content-Length") or str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def fail_next(self, n: int, mode: str = "slowdown") -> None:
        with self.lock:
            self.faults, self.mode, self.failed = n, mode, 0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def flaky(s3_target: S3Target) -> Iterator[FlakyProxy]:
    proxy = FlakyProxy(s3_target.url)
    yield proxy
    proxy.close()


@pytest.mark.parametrize("mode", ["slowdown", "drop"])
def test_retries_transient_failures(s3_target: S3Target, flaky: FlakyProxy, mode: str) -> None:
    bucket, prefix = _split(s3_target.root)
    # botocore's own retries off, so every retry seen here is ours; no pacing (test_s3_adaptive's).
    store = S3Store(
        bucket, prefix, endpoint_url=flaky.url, max_attempts=1, retries=3, backoff=0.01, retry_mode="standard"
    )
    with store:
        flaky.fail_next(2, mode)
        store.put("k", b"value")
        assert flaky.failed == 2
        flaky.fail_next(3, mode)
        assert store.get("k") == b"value"
        assert flaky.failed == 3
        flaky.fail_next(2, mode)
        assert store.put_if_absent("c", b"1") is True
        flaky.fail_next(100, mode)
        with pytest.raises(StorageError) as e:
            store.get("k")
        assert flaky.failed == 4  # 1 try + 3 retries
        assert "after 4 attempts" in str(e.value) and "s3://" in str(e.value)
        if mode == "slowdown":
            assert "SlowDown" in str(e.value) and "503" in str(e.value)
        flaky.fail_next(0)
        assert store.get("c") == b"1"


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _sent(store: S3Store) -> list[tuple[str, str, dict[str, str]]]:
    """(method, url, headers) of every request the store's client sends from now on."""
    sent: list[tuple[str, str, dict[str, str]]] = []

    def record(request, **_) -> None:
        sent.append((request.method, request.url, {k.lower(): _text(v) for k, v in request.headers.items()}))

    store._client.meta.events.register("before-send.s3.*", record)
    return sent


@pytest.mark.parametrize("calculation", ["when_supported", "when_required"])
def test_payload_hash_over_http_only_until_the_server_checks_the_body_checksum(
    s3_target: S3Target, monkeypatch: pytest.MonkeyPatch, calculation: str
) -> None:
    """Over http botocore SHA-256 signs every body (a second pass over the checkpoint). With a
    CRC32 on every PUT we skip that hash once a response echoes the CRC32, which shows that the
    server checks it (moto echoes it); Ceph RGW 16.2 does not, so there every body stays signed."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", calculation)
    data = os.urandom(3 * MiB)
    with small_parts(s3_target.root) as store:
        sent = _sent(store)
        store.put("one", data)
        store.put("multi", data * 4)  # 12 MiB: a multipart upload of 5 MiB parts
        assert store.get("one") == data and store.get("multi") == data * 4
    bodies = [h for method, _, h in sent if method == "PUT" and int(h.get("content-length", 0)) >= MiB]
    assert len(bodies) == 4  # the single PUT and three parts
    signed = [len(h["x-amz-content-sha256"]) == 64 for h in bodies]  # the body's SHA-256, hex
    if calculation == "when_required":
        assert signed == [True] * 4
        assert not any("x-amz-checksum-crc32" in h for h in bodies)
        return
    assert all("x-amz-checksum-crc32" in h for h in bodies)
    if s3_target.name == "rgw":
        assert signed == [True] * 4
    else:  # the first response echoed the CRC32: the parts go unsigned
        assert signed == [True, False, False, False]
        assert all(h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD" for h in bodies[1:])


def test_a_body_corrupted_in_flight_is_refused_by_rgw(rgw_server: str, rgw_bucket: str) -> None:
    """Ceph RGW 16.2 does not check the x-amz-checksum-crc32 header: with an unsigned payload it
    stored a body whose bit flipped on the way. The store keeps signing bodies there, so RGW
    refuses it. (moto checks neither, so this runs against RGW only.)"""
    bucket, prefix = _split(rgw_bucket)
    proxy = FlakyProxy(rgw_server)
    try:
        with S3Store(bucket, prefix, endpoint_url=proxy.url, max_attempts=1, retries=0) as store:
            store.put("first", b"a body that reaches the server intact")
            proxy.fail_next(1, "corrupt")
            with pytest.raises(StorageError, match="PutObject failed") as e:
                store.put("k", b"a body that is corrupted on its way")
            assert "s3://" in str(e.value) and "\n" not in str(e.value)
            assert not store.exists("k")
            proxy.fail_next(1, "corrupt")
            with pytest.raises(StorageError):
                store.put_if_absent("c", b"a commit record corrupted on its way")
            assert not store.exists("c")
    finally:
        proxy.close()


def test_an_object_up_to_two_parts_is_one_put(s3_target: S3Target) -> None:
    s3_bucket, client = s3_target.root, s3_target.client()
    """A shard a little over one part is one PutObject, not create + two parts + complete."""
    bucket, prefix = _split(s3_bucket)
    data = os.urandom(MIN_PART_SIZE + 100)
    with S3Store(bucket, prefix, part_size=MIN_PART_SIZE, max_workers=2) as store:
        sent = _sent(store)
        store.put("k", data)
        store.put("big", data * 2)  # over two parts: multipart
        assert store.get("k") == data
    assert [m for m, url, _ in sent if url.split("?")[0].endswith("/k") and m != "GET"] == ["PUT"]
    assert "-" not in client.head_object(Bucket=bucket, Key=f"{prefix}/k")["ETag"]
    assert client.head_object(Bucket=bucket, Key=f"{prefix}/big")["ETag"].strip('"').endswith("-3")


def test_a_range_up_to_two_parts_is_one_get(s3_target: S3Target) -> None:
    """A shard a little over one part is read back as one GET, as it was written as one PUT: not
    a HEAD (size, ETag) and two ranged GETs pinned by If-Match."""
    bucket, prefix = _split(s3_target.root)
    data = os.urandom(MIN_PART_SIZE + 100)
    with S3Store(bucket, prefix, part_size=MIN_PART_SIZE, max_workers=2) as store:
        store.put("k", data)
        store.put("big", data * 2)  # over two parts: pieces pinned to one version
        sent = _sent(store)
        out = bytearray(len(data))
        store.get_range_into("k", 0, [out])
        assert out == data and store.get_range("k", 50, len(data) - 50) == data[50:]
        assert [m for m, url, _ in sent] == ["GET", "GET"]
        del sent[:]
        assert store.get_range("big", 0, 2 * len(data)) == data * 2
        assert [m for m, _, _ in sent].count("HEAD") == 1
        assert all(h.get("if-match") for m, _, h in sent if m == "GET")


def test_small_bodies_do_not_wait_for_100_continue(s3_target: S3Target) -> None:
    """botocore waits for the server's 100 Continue before every PUT body: a round trip that a
    small object (each zarr.json) costs more than its body. Large bodies still wait for it, so
    the server can refuse one (412) before it travels."""
    bucket, prefix = _split(s3_target.root)
    with S3Store(bucket, prefix, part_size=MIN_PART_SIZE, max_workers=2) as store:
        sent = _sent(store)
        store.put("small", b"x" * 1000)
        store.put_new("small-new", [memoryview(b"y" * 100)] * 3)
        store.put("large", os.urandom(2 * MiB))
        assert store.get("small") == b"x" * 1000 and store.get("small-new") == b"y" * 300
    expect = {url.split("?")[0].rsplit("/", 1)[-1]: h.get("expect") for m, url, h in sent if m == "PUT"}
    assert expect == {"small": None, "small-new": None, "large": "100-continue"}


def _rival_lands_first(store: S3Store, rival: S3Store, key: str) -> list[str]:
    """Just before ``store`` sends its conditional write (PutObject or CompleteMultipartUpload
    with ``If-None-Match: *``), ``rival`` writes ``key``: the race two writers run at a commit,
    made deterministic. Returns the operations that saw the rival land (at most one)."""
    fired: list[str] = []

    def land(params: dict, model, **_) -> None:
        if params.get("IfNoneMatch") == "*" and not fired:
            fired.append(model.name)
            rival.put(key, b"rival")

    for op in ("PutObject", "CompleteMultipartUpload"):
        store._client.meta.events.register(f"provide-client-params.s3.{op}", land)
    return fired


def test_put_if_absent_over_the_multipart_threshold_loses_a_race(s3_target: S3Target) -> None:
    """Ceph RGW 16.2 ignores If-None-Match on CompleteMultipartUpload and overwrites: an object
    over the multipart threshold must still go up as one conditional PutObject, or both racing
    writers of a commit record would win there."""
    data = os.urandom(6 * MiB)  # over small_parts' 5 MiB multipart threshold
    with small_parts(s3_target.root) as store, small_parts(s3_target.root) as rival:
        fired = _rival_lands_first(store, rival, "big/commit")
        assert store.put_if_absent("big/commit", data) is False
        assert fired == ["PutObject"]
        assert store.get("big/commit") == b"rival"


def test_put_if_absent_above_the_single_put_limit(s3_target: S3Target) -> None:
    """Above ``max_put_size`` put_if_absent must be a multipart upload: moto honours the
    condition on its Complete, so the race is lost cleanly; RGW 16.2 does not, which the store's
    probe finds, so it refuses with one clear error and writes nothing (no probe object left)."""
    data = os.urandom(6 * MiB)
    client = s3_target.client()
    with small_parts(s3_target.root, max_put_size=MIN_PART_SIZE) as store, small_parts(s3_target.root) as rival:
        if s3_target.name == "rgw":
            with pytest.raises(StorageError, match="ignores If-None-Match on CompleteMultipartUpload") as e:
                store.put_if_absent("big/commit", data)
            assert "s3://" in str(e.value) and "\n" not in str(e.value)
            assert not store.exists("big/commit")
            with pytest.raises(StorageError, match="ignores If-None-Match"):  # the answer is kept
                store.put_if_absent("big/other", data)
        else:
            assert store.put_if_absent("big/commit", data) is True
            assert store.put_if_absent("big/commit", data) is False
            assert store.get("big/commit") == data
            fired = _rival_lands_first(store, rival, "big/race")
            assert store.put_if_absent("big/race", data) is False
            assert fired == ["CompleteMultipartUpload"]
            assert store.get("big/race") == b"rival"
        small = b"x" * MiB  # below the limit: one PutObject, on every server
        assert store.put_if_absent("small/commit", small) is True
        assert store.put_if_absent("small/commit", b"y") is False
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_target.bucket).get("Contents", []))
    expect = ["job/small/commit"] if s3_target.name == "rgw" else ["job/big/commit", "job/big/race", "job/small/commit"]
    assert keys == expect  # no probe object left beside the root
    assert client.list_multipart_uploads(Bucket=s3_target.bucket).get("Uploads", []) == []
