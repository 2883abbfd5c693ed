"""The memory tier's data path: bulk tier reads served by threads, outside the HTTP server's
event loop (docs/operations.md, "Transport").

``POST /v1/tiers/read`` moves every byte through uvicorn's asyncio loop (one ASGI message per
part, one loop iteration per socket write), which costs more than the copy itself. This listener
answers the same reads on plain sockets (TCP ``CKPTD_TIER_DATA_PORT`` and the Unix socket
``ckptd-tiers.sock``, both advertised by ``GET /v1/tiers`` as ``"data"``), one thread per
connection, writing the held buffers themselves (``sendall`` of the views: no join, no copy).

Wire (``ckptd.tierwire``): a request frame's JSON header is ``{"token", "op", "root", "step",
"attempt", ...}``; ``op`` is

* ``read`` with ``ranges`` ([key, start, length] each): one reply header ``{"ok": true, "step",
  "attempt", "length"}`` followed by exactly ``length`` bytes, the ranges concatenated;
* ``fds`` with ``keys`` (Unix socket only): one reply header ``{"ok": true, "step", "attempt",
  "sizes"}`` carrying the sealed memfd descriptors of the objects (``server.sealed``); the rank
  maps them ``PROT_READ``. No byte of the objects crosses the socket.

The rules are the HTTP routes' (``server.peers``; docs/operations.md, "Why this is safe"): the
daemon token in every request, the root served and readable by the caller (a Unix caller is named
by ``SO_PEERCRED``), objects looked up in the tier table only, the batch caps of ``server.tiers``.
Anything else gets one error reply ``{"ok": false, "status", "detail"}`` and the connection is
closed. A request must arrive whole within ``timeout_s``, so slow or half-closed clients cannot
hold the threads. Connections are capped per listener (TCP and the Unix socket each hold at most
``max_connections``) with the HTTP server's rules (``server.conns``): a connection is *pending*
until a request with the right token arrived, which it must within ``FIRST_REQUEST_S``; over a cap
(or ``max_pending_per_client`` pending of one address, or one uid on the socket) the oldest pending
one is closed, so idle connections without the token cannot lock trainers out.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from pathlib import Path

from ckptd.server.conns import ConnectionLimits
from ckptd.server.parts import MAX_NUMBER, Daemon
from ckptd.server.roots import RootError
from ckptd.server.settings import Settings
from ckptd.server.tenancy import PEER_KEY, Forbidden, listen_unix, peer_of, release_unix
from ckptd.server.tiers import MAX_BATCH_RANGES
from ckptd.tierwire import MAX_FDS, REPLY, REQUEST, WireError, recv_frame, send_frame

__all__ = ["TierData"]

log = logging.getLogger("ckptd.tierdata")

MAX_KEY = 4096
MAX_ATTEMPT = 64
DRAIN_BYTES = 1 << 20
FIRST_REQUEST_S = 2.0  # a pending connection's time for its first request


class _Conn:
    """A data connection as ``ConnectionLimits`` sees it: ``transport.abort()`` ends it now."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.transport, self.since = sock, self, time.monotonic()

    def abort(self) -> None:  # the serving thread's recv returns; that thread closes the socket
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class _Refused(Exception):
    """(status, detail): one error reply, then the end of the connection."""


def _is_key(k) -> bool:
    return isinstance(k, str) and 0 < len(k) <= MAX_KEY


def _is_range(r) -> bool:
    """[key, start, length], the numbers bounded."""
    if not (isinstance(r, list) and len(r) == 3 and _is_key(r[0])):
        return False
    return all(type(n) is int and -MAX_NUMBER <= n <= MAX_NUMBER for n in r[1:])


class TierData:
    def __init__(self, tiers, daemon: Daemon, token: str | None, settings: Settings, max_connections: int):
        """The rules of ``daemon``'s parts (roots, tenancy); its data socket lies beside its socket."""
        self.tiers, self.roots, self.tenancy = tiers, daemon.roots, daemon.tenancy
        self.token = token.encode() if token is not None else None
        self.timeout_s = settings.request_timeout_s
        host, port = settings.host, settings.tier_data_port
        socket_path = daemon.socket_path.with_name(f"{daemon.socket_path.stem}-tiers.sock")
        self._lock = threading.Lock()  # over both ``limits``
        self._closed = False
        tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            unix = listen_unix(socket_path)
            unix.listen(128)
        except BaseException:
            tcp.close()
            raise
        self._listeners = [tcp, unix]
        self.limits = {
            ls: ConnectionLimits(max_connections, settings.max_pending_per_client, FIRST_REQUEST_S, token)
            for ls in self._listeners
        }
        self.socket_path = Path(socket_path)
        self.port = tcp.getsockname()[1]

    @property
    def connections(self) -> int:  # open now
        return sum(len(lim.open) for lim in self.limits.values())

    @property
    def refused(self) -> int:
        return sum(lim.refused for lim in self.limits.values())

    @property
    def evicted(self) -> int:  # pending connections closed: to make room, or their first request late
        return sum(lim.evicted + lim.timed_out for lim in self.limits.values())

    @property
    def endpoint(self) -> dict:
        return {"port": self.port, "socket": str(self.socket_path)}

    def start(self) -> TierData:
        for ls in self._listeners:
            threading.Thread(target=self._accept, args=(ls,), name="ckptd-tier-data", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        for ls in self._listeners:
            with contextlib.suppress(OSError):
                ls.shutdown(socket.SHUT_RDWR)
            ls.close()
        release_unix(self.socket_path)

    def _accept(self, ls: socket.socket) -> None:
        limits = self.limits[ls]
        ls.settimeout(0.5)  # wakes to close pending connections past their deadline
        while not self._closed:
            with self._lock:
                while limits.pending and (c := next(iter(limits.pending))).since < time.monotonic() - FIRST_REQUEST_S:
                    limits.forget(c)
                    limits.timed_out += 1
                    c.abort()
            try:
                conn, addr = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors: try again, never spin
                continue
            try:
                c, peer = _Conn(conn), peer_of(conn)
            except OSError:  # gone already
                conn.close()
                continue
            with self._lock:  # full of known connections: refused; else the oldest pending one goes
                full = len(limits.open) >= limits.max_connections and not limits.pending
                limits.refused += full
                if not full:
                    limits.admit(c, f"uid {peer.uid}" if peer else addr[0])
            args = (conn,) if full else (c, limits, peer)
            target = self._refuse if full else self._serve
            threading.Thread(target=target, args=args, name="ckptd-tier-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                send_frame(conn, REPLY, {"ok": False, "status": 503, "detail": "too many tier data connections"})

    def _serve(self, c: _Conn, limits: ConnectionLimits, peer) -> None:
        conn = c.sock
        try:
            with conn:
                conn.settimeout(FIRST_REQUEST_S)
                caller = self.tenancy.caller({"state": {PEER_KEY: peer}} if peer is not None else {})
                while not self._closed:
                    try:
                        got = recv_frame(conn, REQUEST)
                    except (WireError, OSError) as e:  # a malformed, oversized or cut-off request
                        self._error(conn, 400, str(e))
                        return
                    if got is None:
                        return
                    try:
                        self._check_token(got[0])
                        with self._lock:
                            limits.unpend(c)  # known: never evicted
                        conn.settimeout(self.timeout_s)
                        self._answer(conn, got[0], caller, peer is not None)
                    except _Refused as e:
                        self._error(conn, *e.args)
                        return
        except OSError as e:  # the reader went away mid-reply: its read fails there, not here
            log.debug("tier data connection closed: %s", e)
        finally:
            with self._lock:
                limits.forget(c)

    @staticmethod
    def _error(conn: socket.socket, status: int, detail: str) -> None:
        """One error reply, then the end of the connection: what the caller still sends is read
        and dropped (at most ``DRAIN_BYTES``, for at most a second) so that the close is a FIN
        after the reply, not a reset that could destroy it."""
        with contextlib.suppress(OSError):
            send_frame(conn, REPLY, {"ok": False, "status": status, "detail": detail[:300]})
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(1.0)
            left = DRAIN_BYTES
            while left > 0:
                got = conn.recv(min(left, 65536))
                if not got:
                    break
                left -= len(got)

    def _check_token(self, h: dict) -> None:
        if self.token is not None:
            given = h.get("token")
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.token):
                raise _Refused(401, "missing or wrong daemon token")

    def _answer(self, conn: socket.socket, h: dict, caller, unix: bool) -> None:
        root, step, attempt, op = h.get("root"), h.get("step"), h.get("attempt"), h.get("op")
        if not isinstance(root, str) or not 0 < len(root) <= 4096:
            raise _Refused(400, "root must be a job root URI")
        if type(step) is not int or not 0 <= step < 10**10:
            raise _Refused(400, "step must be an integer in [0, 10^10)")
        if not isinstance(attempt, str) or not 0 < len(attempt) <= MAX_ATTEMPT:
            raise _Refused(400, "attempt must be a string of 1 to 64 characters")
        if not unix and isinstance(h.get("vouch"), str) and not caller.operator:  # a rank of another node
            caller = self.tenancy.vouched(h["vouch"])
        try:
            root = self.roots.check(root)
            self.tenancy.check_read(caller, root)
        except RootError as e:
            raise _Refused(400, str(e)) from None
        except Forbidden as e:
            raise _Refused(403, str(e)) from None
        self.tiers.count("object_requests")
        self.tiers.count("data_requests")
        if op == "read":
            self._read(conn, h.get("ranges"), root, step, attempt)
        elif op == "fds":
            if not unix:
                raise _Refused(400, "descriptors are passed on the daemon's Unix data socket only")
            self._fds(conn, h.get("keys"), root, step, attempt)
        else:
            raise _Refused(400, "op must be read or fds")

    def _read(self, conn: socket.socket, ranges, root: str, step: int, attempt: str) -> None:
        if not isinstance(ranges, list) or not 0 < len(ranges) <= MAX_BATCH_RANGES:
            raise _Refused(400, f"ranges must be a list of 1 to {MAX_BATCH_RANGES} [key, start, length]")
        if not all(map(_is_range, ranges)):
            raise _Refused(400, "a range is [key, start, length]")
        try:
            parts = self.tiers.read_many(root, step, attempt, [tuple(r) for r in ranges])
        except ValueError as e:
            raise _Refused(416, str(e)) from None
        if parts is None:
            raise _Refused(404, f"no complete copy of step {step} attempt {attempt} holds them")
        send_frame(conn, REPLY, {"ok": True, "step": step, "attempt": attempt, "length": sum(len(p) for p in parts)})
        for p in parts:
            if len(p):
                conn.sendall(p)

    def _fds(self, conn: socket.socket, keys, root: str, step: int, attempt: str) -> None:
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_FDS or not all(map(_is_key, keys)):
            raise _Refused(400, f"keys must be a list of 1 to {MAX_FDS} object keys")
        bufs = self.tiers.shared(root, step, attempt, keys)
        if bufs is None:
            raise _Refused(404, f"no complete, shareable copy of step {step} attempt {attempt} holds them")
        # ``bufs`` keeps every descriptor open until it is sent, even if the copy is dropped now.
        header = {"ok": True, "step": step, "attempt": attempt, "sizes": [len(b) for b in bufs]}
        send_frame(conn, REPLY, header, fds=[b.fd for b in bufs])
