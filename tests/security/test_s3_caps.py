"""Item 8 on S3: a hostile (or broken) S3-compatible server cannot make a reader allocate from
the size it reports. A real HTTP server on loopback answers every GET with a 10-byte body and a
``Content-Range`` claiming 10 TB, or with more bytes than were asked for; before the fix
``get`` allocated a buffer of the claimed size (MemoryError) and read whatever the server sent."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from storage_backends import StorageError
from storage_backends.s3 import S3Store

pytestmark = pytest.mark.timeout(120)


class _Liar(BaseHTTPRequestHandler):
    mode = "huge"

    def do_GET(self):  # noqa: N802 - http.server's name
        asked = int(self.headers.get("Range", "bytes=0-9").rsplit("-", 1)[1]) + 1
        if self.server.mode == "huge":  # a short body, a claimed size of 10 TB
            body, total = b"0123456789", 10**13
        else:  # 1000 bytes more than the range asked for
            body = b"x" * (asked + 1000)
            total = len(body)
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{total}")
        self.send_header("ETag", '"e"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(params=["huge", "more"])
def liar(request, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    server.mode = request.param
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_get_never_allocates_what_the_server_claims(liar):
    store = S3Store("bucket", "job", endpoint_url=liar, region="us-east-1", max_attempts=1, retries=0)
    try:
        with pytest.raises(StorageError, match="more than"):
            store.get("step_0000000001/manifest.json", limit=100)
        with pytest.raises(StorageError):
            store.get("step_0000000001/manifest.json")
    finally:
        store.close()
