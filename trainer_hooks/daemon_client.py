"""The trainer side's HTTP client of ``ckptd serve``: JSON over keep-alive HTTP/1.1.

Only the standard library speaks HTTP here, so training needs no HTTP package. The daemon's
address is ``http://host:port`` or its Unix socket, ``unix:///path/to/ckptd.sock`` (or
``http+unix://`` with the path percent-encoded as the host), where the kernel tells the daemon
which local user calls: on a node shared by several users, leases and hand-offs go there. The
client sends ``Authorization: Bearer`` with the token from ``CKPTD_TOKEN`` or the file named by
``CKPTD_TOKEN_FILE``. ``DaemonClient.call`` waits out a restarting daemon when asked to
(``patient``); ``call_waiting`` also waits while the daemon's staging budget is full (429).
Used by ``daemon_stager`` (leases) and ``daemon_sink`` (jobs, polling); safe to call from
several threads (one connection per thread).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
from urllib.parse import unquote, urlsplit

from ckptd.auth import daemon_token as _token
from ckptd.errors import CheckpointError

__all__ = ["DaemonClient", "DaemonUnreachable", "detail"]

log = logging.getLogger("ckptd.daemon_client")

_WAIT_LOG_EVERY_S = 30.0


class DaemonUnreachable(CheckpointError):
    pass


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix stream socket (the daemon's ``--socket``)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dfd = None
        try:
            sock.settimeout(self.timeout)
            path = self._path
            if len(os.fsencode(path)) >= 108:  # longer than a socket address holds
                head, name = os.path.split(path)
                dfd = os.open(head, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                path = f"/proc/self/fd/{dfd}/{name}"
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        finally:
            if dfd is not None:
                os.close(dfd)
        self.sock = sock


def _unix_path(url: str) -> str | None:
    """The socket path of ``unix:///path`` or ``http+unix://%2Fpath``; None for other URLs."""
    if url.startswith("unix://"):
        path = url[len("unix://") :]
    elif url.startswith("http+unix://"):
        path = unquote(url[len("http+unix://") :].split("/", 1)[0])
    else:
        return None
    if not path.startswith("/"):
        raise CheckpointError(f"daemon socket must be an absolute path (unix:///path/to/ckptd.sock), got {url!r}")
    return path


class _Http:
    """JSON requests over keep-alive HTTP/1.1, one connection per thread."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        path = _unix_path(url)
        if path is not None:
            self._new = lambda: _UnixConnection(path, timeout)
            self._base = ""
        else:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise CheckpointError(
                    f"daemon must be an http://host:port URL or unix:///path/to/ckptd.sock, got {url!r}"
                )
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            host, port = parts.hostname, parts.port
            self._new = lambda: cls(host, port, timeout=timeout)
            self._base = parts.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body or {}, headers). Raises DaemonUnreachable. Requests are idempotent
        (jobs carry a client-chosen id), so a stale keep-alive connection is retried once."""
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._new()
                with self._lock:
                    self._all.append(conn)
            try:
                conn.request(method, self._base + path, body=data, headers=self._headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                if attempt:
                    raise DaemonUnreachable(f"cannot reach the ckptd daemon at {self.url}: {e}") from None
                continue
            try:
                payload = json.loads(raw) if raw else {}
            except ValueError:
                payload = {"detail": raw[:200].decode(errors="replace")}
            return resp.status, payload if isinstance(payload, dict) else {"items": payload}, dict(resp.headers)
        raise AssertionError("unreachable")

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local.conn = None


def detail(body: dict) -> str:
    """The daemon's error message in a reply body."""
    return str(body.get("detail", body))


class DaemonClient:
    """Requests to one daemon on behalf of one rank (``rank`` only names it in logs)."""

    UNREACHABLE_WAIT_S = 60.0  # how long a patient call waits for an unreachable daemon (a restart)

    def __init__(self, daemon_url: str, rank: int):
        self.url = daemon_url.rstrip("/")
        self.rank = rank
        self._http = _Http(self.url, _token())

    def call(self, method: str, path: str, body: dict | None = None, patient: bool = False) -> tuple[int, dict, dict]:
        """One request. ``patient``: while the daemon is unreachable (restarting), retry for up to
        ``UNREACHABLE_WAIT_S``, logging why the save waits."""
        deadline = time.monotonic() + self.UNREACHABLE_WAIT_S
        logged = False
        while True:
            try:
                status, reply, headers = self._http.request(method, path, body)
                break
            except DaemonUnreachable as e:
                if not patient or time.monotonic() > deadline:
                    raise
                if not logged:
                    log.warning("rank %d: save waits for the ckptd daemon: %s", self.rank, e)
                    logged = True
                time.sleep(0.5)
        if status == 401:
            raise CheckpointError(
                f"ckptd daemon at {self.url} refused the request (401): set CKPTD_TOKEN or CKPTD_TOKEN_FILE"
            )
        return status, reply, headers

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
            if waited_since is None:
                waited_since = now
            if now - last_log >= _WAIT_LOG_EVERY_S:
                last_log = now
                log.warning(
                    "rank %d: save waits for staging memory: the ckptd daemon's budget is full (%s of %s bytes "
                    "staged, %d needed)",
                    self.rank,
                    reply.get("staged", "?"),
                    reply.get("budget", "?"),
                    body.get("bytes", 0),
                )
            try:
                retry = float(headers.get("Retry-After", "1"))
            except ValueError:
                retry = 1.0
            time.sleep(min(max(retry, 0.05), 0.25))

    def close(self) -> None:
        self._http.close()
