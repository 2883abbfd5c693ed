"""Fault injection for tests and the fault campaign (``benchmarks.faults``): never used by the
product, kept next to the conformance suite (``testing.py``) as zarr keeps its ``LatencyStore``.

``FaultProxy`` is a real HTTP proxy on loopback in front of an S3-compatible endpoint (the moto
server of the tests). Point ``AWS_ENDPOINT_URL`` at ``proxy.url`` and every request of every
client goes through it; per request it forwards, or injects one fault:

==========  ===========================================================================
``500``     answers 500 InternalError without forwarding
``503``     answers 503 SlowDown without forwarding (S3's throttling answer)
``403``     answers 403 AccessDenied without forwarding (not retried: the call fails at once)
``reset``   closes the connection without forwarding (a connection cut before the request)
``cut``     forwards, then sends half of the response and closes (cut mid-response)
``lost``    forwards (the request takes effect upstream), then drops the response and closes:
            the client cannot tell whether it happened (a lost response to a successful request)
``delay``   sleeps ``delay_s``, then forwards
``stall``   never answers: holds the connection, reading nothing, until ``stall_s`` passes or
            the proxy stops, then closes (a stalled endpoint)
``late``    holds the request until ``release_late()``, then forwards it and answers: a slow
            writer's write (a GC pause, a partition, a throttled link) that lands long after it
            was sent, whatever happened to the key meanwhile
``keyerrors`` a DeleteObjects: forwards it without every other key, and answers the upstream
            result plus a per-key ``InternalError`` for each key left out (S3's partial failure:
            HTTP 200, those keys not deleted)
==========  ===========================================================================

Which requests: ``rules`` first (each a predicate on the ``Request``, a fault and how many times,
consumed in order: "lose the response of the first CreateMultipartUpload"), then a seeded random
``rate`` of the requests with faults drawn from ``kinds``. ``counters`` counts requests per S3
operation and faults per kind; ``peak`` the most requests of each operation in flight at once
(being answered or held) over the proxy's life. ``stall_all()`` makes every later request stall (the endpoint
stops answering) until ``resume()``.

``FailingStore`` wraps any ``Store`` and raises ``EIO`` (as ``StorageError`` wrapping an
``OSError``) on chosen puts. It exists because this machine has no real way to make a
filesystem return EIO on demand (the device-mapper ``error`` target needs ``/dev/mapper``,
absent in these containers); ENOSPC, in contrast, comes for real from a small tmpfs
(``tmpfs_mount``).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import os
import random
import re
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from storage_backends.base import Data, StorageError, Store

__all__ = ["FailingStore", "FaultPlan", "FaultProxy", "KINDS", "Request", "Rule", "tmpfs_mount"]

KINDS = ("500", "503", "reset", "cut", "lost", "delay")  # the random kinds; rules may also use "late"

_ERROR_BODY = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),  # not retried: fails the call at once
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names

    @property
    def op(self) -> str:
        """The S3 operation, from the method and query (path-style addressing)."""
        q, m = self.query, self.method
        if "uploads" in q:
            return "CreateMultipartUpload" if m == "POST" else "ListMultipartUploads"
        if "uploadId" in q:
            return {"PUT": "UploadPart", "POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(
                m, "ListParts"
            )
        if m == "POST" and "delete" in q:
            return "DeleteObjects"
        bucket_only = self.path.strip("/").count("/") == 0
        if m == "GET":
            return "ListObjectsV2" if bucket_only else "GetObject"
        if m == "HEAD":
            return "HeadBucket" if bucket_only else "HeadObject"
        if m == "PUT":
            if bucket_only:
                return "CreateBucket"
            return "CopyObject" if "x-amz-copy-source" in self.headers else "PutObject"
        if m == "DELETE":
            return "DeleteBucket" if bucket_only else "DeleteObject"
        return m


@dataclass
class Rule:
    """Inject ``kind`` into the next ``times`` requests that ``match``."""

    match: Callable[[Request], bool]
    kind: str
    times: int = 1


@dataclass
class FaultPlan:
    rate: float = 0.0  # share of requests (after the rules) that get a random fault
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    delay_s: float = 0.2
    stall_s: float | None = None  # None: until the proxy stops
    rules: list[Rule] = field(default_factory=list)
    # requests a random fault may hit (e.g. only writes); all when None
    only: Callable[[Request], bool] | None = None


class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1; see the module docstring. One thread per client
    connection (boto3 keeps a pool of them alive), one upstream connection per request."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"FaultProxy forwards to plain http endpoints, not {upstream!r}")
        self.upstream = (u.hostname, u.port or 80)
        self.plan = plan or FaultPlan()
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self._inflight: Counter[str] = Counter()
        self._stalled = threading.Event()
        self._late = threading.Event()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._acceptor.start()

    # -- control ----------------------------------------------------------------------------------

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self.plan = plan
            self._rng = random.Random(plan.seed)

    def stall_all(self) -> None:
        """From now on no request is answered (until ``resume``)."""
        self._stalled.set()

    def resume(self) -> None:
        self._stalled.clear()

    def release_late(self) -> None:
        """Forward every request held by a ``late`` rule, and the later ones at once."""
        self._late.set()

    def faults(self) -> int:
        with self._lock:
            return sum(v for k, v in self.counters.items() if k.startswith("fault:"))

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in list(self._threads):
            t.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- serving ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="fault-proxy-conn", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _choose(self, req: Request) -> str | None:
        with self._lock:
            self.counters["requests"] += 1
            self.counters[f"op:{req.op}"] += 1
            if self._stalled.is_set():
                kind: str | None = "hold"
            else:
                kind = None
                for rule in self.plan.rules:
                    if rule.times > 0 and rule.match(req):
                        rule.times -= 1
                        kind = rule.kind
                        break
                eligible = self.plan.rate > 0 and (self.plan.only is None or self.plan.only(req))
                if kind is None and eligible and self._rng.random() < self.plan.rate:
                    kind = self._rng.choice(self.plan.kinds)
            if kind is not None:
                name = "stall" if kind == "hold" else kind
                self.counters[f"fault:{name}"] += 1
                self.counters[f"fault:{name}:{req.op}"] += 1
            return kind

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                parsed = _read_request(f, conn)
                if parsed is None:
                    return
                req, raw = parsed
                if not self._handle(conn, req, raw):
                    return
        except (OSError, ValueError, http.client.HTTPException):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                f.close()
                conn.close()

    def _handle(self, conn: socket.socket, req: Request, raw: bytes) -> bool:
        """Serve one request; False when the connection must close."""
        with self._lock:
            self._inflight[req.op] += 1
            self.peak[req.op] = max(self.peak[req.op], self._inflight[req.op])
        try:
            return self._handle_one(conn, req, raw)
        finally:
            with self._lock:
                self._inflight[req.op] -= 1

    def _handle_one(self, conn: socket.socket, req: Request, raw: bytes) -> bool:
        kind = self._choose(req)
        plan = self.plan
        if kind in _ERROR_BODY:
            conn.sendall(_error_response(*_ERROR_BODY[kind]))
            return True
        if kind == "reset":
            _reset(conn)
            return False
        if kind in ("stall", "hold"):
            # "hold" (stall_all) lasts until resume(); a scheduled "stall" for stall_s.
            deadline = None if kind == "hold" or plan.stall_s is None else time.monotonic() + plan.stall_s
            while not self._stop.is_set():
                if kind == "hold" and not self._stalled.is_set():
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            _reset(conn)  # never answered
            return False
        if kind == "delay":
            time.sleep(plan.delay_s)
        if kind == "late":
            while not self._late.wait(0.05):
                if self._stop.is_set():
                    _reset(conn)
                    return False
        if kind == "keyerrors" and req.op == "DeleteObjects":
            raw, failed = _leave_out_keys(raw)
            response = _with_key_errors(self._forward(req, raw), failed)
        else:
            response = self._forward(req, raw)
        if kind == "lost":
            _reset(conn)
            return False
        if kind == "cut":
            conn.sendall(response[: max(1, len(response) // 2)])
            _reset(conn)
            return False
        conn.sendall(response)
        return True

    def _forward(self, req: Request, raw: bytes) -> bytes:
        up = socket.create_connection(self.upstream, timeout=120)
        try:
            up.sendall(raw)
            resp = http.client.HTTPResponse(up, method=req.method)
            resp.begin()
            body = resp.read()
            head = [f"HTTP/1.1 {resp.status} {resp.reason}"]
            for name, value in resp.getheaders():
                if name.lower() in ("transfer-encoding", "content-length", "connection"):
                    continue
                head.append(f"{name}: {value}")
            if req.method != "HEAD" or resp.getheader("content-length") is None:
                head.append(f"Content-Length: {len(body)}")
            else:
                head.append(f"Content-Length: {resp.getheader('content-length')}")
            return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        finally:
            up.close()


_KEY = re.compile(rb"<Object>\s*<Key>(.*?)</Key>.*?</Object>", re.DOTALL)
_DROPPED_HEADERS = (b"content-length:", b"content-md5:", b"x-amz-checksum-", b"x-amz-sdk-checksum-algorithm:")


def _leave_out_keys(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A DeleteObjects request without every other key (the 2nd, 4th, ...), its length and
    checksum headers adjusted (moto checks neither signature nor payload hash); and those keys."""
    head, _, body = raw.partition(b"\r\n\r\n")
    objects = list(_KEY.finditer(body))
    failed = [m.group(1) for m in objects[1::2]]
    kept = b"".join(m.group(0) for m in objects[0::2])
    body = re.sub(rb"<Object>.*</Object>", lambda _: kept, body, count=1, flags=re.DOTALL)
    lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(_DROPPED_HEADERS)]
    lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body, failed


def _with_key_errors(response: bytes, keys: list[bytes]) -> bytes:
    head, _, body = response.partition(b"\r\n\r\n")
    errors = b"".join(
        b"<Error><Key>%s</Key><Code>InternalError</Code><Message>We encountered an internal error. "
        b"Please try again.</Message></Error>" % k
        for k in keys
    )
    if b"</DeleteResult>" in body:
        body = body.replace(b"</DeleteResult>", errors + b"</DeleteResult>", 1)
    else:  # an empty quiet result: <DeleteResult/>
        body = re.sub(
            rb"<DeleteResult([^>]*)/>",
            lambda m: b"<DeleteResult" + m.group(1) + b">" + errors + b"</DeleteResult>",
            body,
        )
    lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"content-length:")]
    lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dead peer or a middlebox would."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        conn.close()


def _error_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _read_request(f, conn: socket.socket) -> tuple[Request, bytes] | None:
    """One request from the client: (parsed, raw bytes to forward upstream). ``Expect:
    100-continue`` is answered here and dropped from what is forwarded."""
    line = f.readline(65537)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    lines, headers = [], {}
    while True:
        h = f.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
        if name.strip().lower() not in ("expect", "connection"):
            lines.append(h)
    if headers.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = b""
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size_line = f.readline(65537)
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    t = f.readline(65537)
                    parts.append(t)
                    if t in (b"\r\n", b"\n", b""):
                        break
                break
            parts.append(f.read(size + 2))
        body = b"".join(parts)
    u = urlsplit(target)
    req = Request(method, u.path, parse_qs(u.query, keep_blank_values=True), headers)
    raw = line + b"".join(lines) + b"Connection: close\r\n\r\n" + body
    return req, raw


# ------------------------------------------------------------------------------ local faults


@contextlib.contextmanager
def tmpfs_mount(path: str, size: str) -> Iterator[str]:
    """Mount a fresh tmpfs of ``size`` (``"4m"``) at ``path`` (created), unmount afterwards.
    Needs root (CAP_SYS_ADMIN); raises OSError with mount's own message when it cannot."""
    os.makedirs(path, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path], capture_output=True, text=True
    )
    if res.returncode != 0:
        raise OSError(errno.EPERM, f"mount -t tmpfs failed: {res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


class FailingStore(Store):
    """``store`` whose puts of keys matching ``fail`` raise EIO (see the module docstring for
    why this is a wrapper and not a real device)."""

    def __init__(self, store: Store, fail: Callable[[str], bool]) -> None:
        self._store = store
        self._fail = fail
        self.uri = store.uri
        self.failed = 0

    def _check(self, key: str) -> None:
        if self._fail(key):
            self.failed += 1
            e = OSError(errno.EIO, os.strerror(errno.EIO), key)
            raise StorageError(f"{self.uri}: put of {key!r} failed: {e}") from e

    def put(self, key: str, data: Data) -> None:
        self._check(key)
        self._store.put(key, data)

    def put_deferred(self, key: str, data: Data) -> None:
        self._check(key)
        self._store.put_deferred(key, data)

    def put_if_absent(self, key: str, data: Data) -> bool:
        self._check(key)
        return self._store.put_if_absent(key, data)

    def put_new(self, key: str, data: Data) -> object:
        self._check(key)
        return self._store.put_new(key, data)

    def delete_if(self, key: str, tag: object) -> bool:
        return self._store.delete_if(key, tag)

    def __getattr__(self, name):
        return getattr(self._store, name)

    # the abstract verbs, delegated
    def get(self, key: str, limit: int | None = None) -> bytes:
        return self._store.get(key, limit=limit)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._store.get_range(key, start, length)

    def delete(self, key: str) -> None:
        self._store.delete(key)

    def list(self, prefix: str = ""):
        return self._store.list(prefix)

    def list_dir(self, prefix: str = ""):
        return self._store.list_dir(prefix)

    def sync(self) -> None:
        self._store.sync()

    def purge(self, prefix: str) -> tuple[int, int]:
        return self._store.purge(prefix)

    def delete_prefix(self, prefix: str) -> int:
        return self._store.delete_prefix(prefix)

    def close(self) -> None:
        self._store.close()
