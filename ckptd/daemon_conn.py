"""The one way to reach a ``ckptd serve`` daemon, for every caller: the trainer (hand-off,
staging, memory tiers, memory-only steps, fence), the CLI (``ckptd ls --daemon``) and the daemons
themselves (replication, the discovery challenge). Standard-library HTTP/1.1 only.

An address is ``unix:///abs/path/ckptd.sock`` or ``http+unix://%2Fabs%2Fpath%2Fckptd.sock`` (the
daemon's Unix socket, where the kernel names the calling user: leases and hand-offs go there), or
``http(s)://host:port[/base]``. ``resolve(True)``, a trainer's ``daemon=True``: ``CKPTD_DAEMON``,
else ``default_socket()``, where ``ckptd serve`` listens by default.

``DaemonConnection`` keeps one keep-alive connection per thread and sends the bearer token it
holds; a daemon's connection to a peer daemon also signs each request with the peer key
(``peer``, ``peer_auth``: the header ``server.peers.peer_sender`` checks). A kept connection
that turns out stale is replaced once (requests are idempotent or carry a client-chosen id,
and are signed again); a fresh one that fails is ``DaemonUnreachable``, naming what to set.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ckptd.errors import CheckpointError

__all__ = [
    "PEER_HEADER",
    "VOUCH_S",
    "DaemonConnection",
    "DaemonUnreachable",
    "default_socket",
    "detail",
    "peer_auth",
    "peer_mac",
    "resolve",
    "unix_address",
]

log = logging.getLogger("ckptd.daemon_conn")

MAX_REPLY = 64 << 20  # a reply read whole (JSON, a listing) may be at most this long
_WAIT_LOG_EVERY_S = 30.0
VOUCH_HEADER = "X-Ckptd-Vouch"  # "<uid> <expiry> <root> <HMAC>": a reader vouched for by its own daemon
VOUCH_S = 120  # how long a reader's ticket (``Tenancy.vouch``) is good for: a restore asks again at half
PEER_HEADER = "X-Ckptd-Peer"  # "<sender URL> <unix time> <nonce> <HMAC-SHA256>" (``peer_auth``)
_HINT = "start `ckptd serve`, or name its address in CKPTD_DAEMON (its socket: --socket / CKPTD_SOCKET)"


class DaemonUnreachable(CheckpointError):
    """The daemon did not answer (gone, not started, a wrong address), or its reply broke off or
    was over the cap."""


def default_socket() -> Path:
    """The daemon's socket when none is named: ``CKPTD_SOCKET``, else ``/run/ckptd/ckptd.sock``
    where ``/run`` is writable (or that folder exists), else ``/dev/shm/ckptd/ckptd.sock``. It
    depends on nothing the daemon serves, so a trainer finds it without being told."""
    if os.environ.get("CKPTD_SOCKET"):
        return Path(os.environ["CKPTD_SOCKET"])
    run = os.path.isdir("/run/ckptd") or os.access("/run", os.W_OK)
    return Path("/run/ckptd/ckptd.sock" if run else "/dev/shm/ckptd/ckptd.sock")


def resolve(daemon: str | bool | None) -> str | None:
    """The address a ``daemon`` argument means: True -> ``CKPTD_DAEMON``, else the default
    socket; a string as given; None/False -> no daemon."""
    if daemon is True:
        return os.environ.get("CKPTD_DAEMON") or f"unix://{default_socket()}"
    return daemon or None


def detail(body: dict) -> str:
    """The daemon's error message in a reply body."""
    return str(body.get("detail", body))


def peer_mac(key: bytes, method: str, target: str, body, when: str, nonce: str, sender: str) -> str:
    """HMAC-SHA256, keyed by the peer key, of a request: method, path and query, body digest,
    time, nonce and the sender's advertised URL."""
    digest = hashlib.sha256(body or b"").hexdigest()
    return hmac.new(key, "\n".join([method, target, digest, when, nonce, sender]).encode(), hashlib.sha256).hexdigest()


def peer_auth(key: bytes, sender: str, method: str, target: str, body) -> str:
    """The ``PEER_HEADER`` value that signs one request of the daemon ``sender`` to a peer."""
    when, nonce = str(int(time.time())), os.urandom(16).hex()
    return f"{sender} {when} {nonce} {peer_mac(key, method, target, body, when, nonce, sender)}"


@contextlib.contextmanager
def unix_address(path: str | os.PathLike) -> Iterator[str]:
    """The address to bind or connect the Unix socket ``path`` at: ``path`` itself, or, when it
    is longer than a socket address holds (108 bytes with its NUL), its name under a descriptor
    of its folder in ``/proc/self/fd`` (open while the block runs)."""
    if len(os.fsencode(path)) < 108:
        yield str(path)
        return
    head, name = os.path.split(path)
    dfd = os.open(head, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{dfd}/{name}"
    finally:
        os.close(dfd)


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix stream socket."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # closed by close() on failure
        self.sock.settimeout(self.timeout)
        with unix_address(self._path) as address:
            self.sock.connect(address)


class DaemonConnection:
    """Requests to one daemon, one keep-alive connection per thread. ``token``: sent as a bearer
    token (assign ``token`` later to start sending one). ``timeout``: seconds per socket
    operation. ``who`` names the caller in the log lines of waiting calls."""

    UNREACHABLE_WAIT_S = 60.0  # how long a patient call waits for an unreachable daemon (a restart)

    def __init__(self, url: str, token: str | None, timeout: float = 30.0, who: str = "client"):
        bad = CheckpointError(f"daemon must be unix:///path/to/ckptd.sock or http://host:port, got {url!r}")
        if not isinstance(url, str):
            raise bad
        self.url, self.token, self.who = url.rstrip("/"), token, who
        self.reconnect = True  # False: a kept connection that breaks is an error, not replaced
        self.peer: tuple[bytes, str] | None = None  # (peer key, this daemon's URL): sign each request
        # a ticket naming the caller to a peer daemon (``Tenancy.vouch``), or what answers a fresh one
        self.vouch: str | Callable[[], str | None] | None = None
        self.host: str | None = None  # the TCP host (None over a Unix socket)
        self._base = ""
        if url.startswith(("unix://", "http+unix://")):
            path = url[7:] if url.startswith("unix://") else unquote(url[12:].split("/", 1)[0])
            if not path.startswith("/"):
                raise bad
            self._new = lambda: _UnixConnection(path, timeout)
        else:
            try:
                parts = urlsplit(url)
                port = parts.port
            except ValueError:
                raise bad from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise bad
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            self.host, self._base = parts.hostname, parts.path.rstrip("/")
            self._new = lambda: cls(parts.hostname, port, timeout=timeout)
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    def send(self, method: str, path: str, body=None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send one request (``body``: a dict sent as JSON, or bytes); return this thread's
        connection and the response, its body unread: read it whole before the next request on
        this thread, or ``drop`` the connection."""
        hdrs = {"Accept": "application/json"}
        if isinstance(body, dict):
            body = json.dumps(body).encode()
            hdrs["Content-Type"] = "application/json"
        elif body is not None:
            hdrs["Content-Type"] = "application/octet-stream"
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        if vouch := self.vouch() if callable(self.vouch) else self.vouch:
            hdrs[VOUCH_HEADER] = vouch
        while True:
            if self.peer:  # signed afresh for each try: a resent request is not a replay
                hdrs[PEER_HEADER] = peer_auth(*self.peer, method, self._base + path, body)
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._new()
                with self._lock:
                    self._all.append(conn)
            try:
                conn.request(method, self._base + path, body=body, headers=hdrs)
                return conn, conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self.drop(conn)
                if not reused or not self.reconnect:  # a fresh connection failed: the daemon is not there
                    raise DaemonUnreachable(f"cannot reach the ckptd daemon at {self.url}: {e}; {_HINT}") from None

    def fetch(self, method: str, path: str, body=None, cap: int = MAX_REPLY) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one request; a body over ``cap`` bytes is DaemonUnreachable."""
        conn, resp = self.send(method, path, body)
        try:
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise DaemonUnreachable(f"{self.url}: reply of {length} bytes where at most {cap} were expected")
            raw = resp.read(cap + 1)
            if len(raw) > cap:
                raise DaemonUnreachable(f"{self.url}: reply over {cap} bytes")
        except DaemonUnreachable:
            self.drop(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self.drop(conn)
            raise DaemonUnreachable(f"{self.url}: {e or type(e).__name__}") from None
        return resp.status, dict(resp.headers), raw

    def call(self, method: str, path: str, body: dict | None = None, patient: bool = False) -> tuple[int, dict, dict]:
        """(status, JSON body or {}, headers). ``patient``: while the daemon is unreachable (a
        restart), retry for up to ``UNREACHABLE_WAIT_S``, logging why the caller waits. A 401 is
        a CheckpointError naming the variables that carry the token."""
        deadline = time.monotonic() + self.UNREACHABLE_WAIT_S
        logged = False
        while True:
            try:
                status, headers, raw = self.fetch(method, path, body)
                break
            except DaemonUnreachable as e:
                if not patient or time.monotonic() > deadline:
                    raise
                if not logged:
                    log.warning("%s waits for the ckptd daemon: %s", self.who, e)
                    logged = True
                time.sleep(0.5)
        if status == 401:
            raise CheckpointError(
                f"ckptd daemon at {self.url} refused the request (401): set CKPTD_TOKEN or CKPTD_TOKEN_FILE"
            )
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"detail": raw[:200].decode(errors="replace")}
        return status, payload if isinstance(payload, dict) else {"items": payload}, headers

    def call_waiting(self, method: str, path: str, body: dict) -> dict:
        """A staging request; while the daemon answers 429 (budget full) wait and ask again."""
        waited_since = None
        last_log = 0.0
        while True:
            status, reply, headers = self.call(method, path, body, patient=True)
            if status == 200:
                if waited_since is not None:
                    log.info("staging memory granted after waiting %.1f s", time.monotonic() - waited_since)
                return reply
            if status not in (429, 503):
                raise CheckpointError(f"ckptd daemon at {self.url}: {method} {path} failed ({status}): {detail(reply)}")
            now = time.monotonic()
            waited_since = waited_since or now
            if now - last_log >= _WAIT_LOG_EVERY_S:
                last_log = now
                log.warning(
                    "%s: save waits for staging memory: the ckptd daemon's budget is full (%s of %s bytes "
                    "staged, %d needed)",
                    self.who,
                    reply.get("staged", "?"),
                    reply.get("budget", "?"),
                    body.get("bytes", 0),
                )
            try:
                retry = float(headers.get("Retry-After", "1"))
            except ValueError:
                retry = 1.0
            time.sleep(min(max(retry, 0.05), 0.25))

    def drop(self, conn: http.client.HTTPConnection) -> None:
        """Close ``conn`` (a reply left unread or broken); this thread's next request opens another."""
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local.conn = None
