"""Connection limits of the daemon's HTTP server (``guarded_protocol``: uvicorn's h11 protocol with
these rules; docs/security.md, "Slow clients cannot starve the daemon", gives the attack). Every
connection holds a file descriptor, so clients that connect and send nothing must not hold them.

A request must arrive whole within ``request_timeout_s`` of its first byte. A connection is
*pending* until it delivered one whole request (with the right bearer token, when the daemon has
one); over ``max_pending_per_client`` per address or ``max_connections`` in all, the *oldest
pending* connection is closed (the newcomer's own address's, else any), so a flood evicts itself
while a newcomer that sends its request at once gets through. A connection that delivered an
authenticated request is never evicted; while such connections fill every slot, newcomers are
refused (without a token, any request counts). The tier data path (``server.tierdata``) keeps its
connections by the same rules.

The HTTP server calls it on its event loop thread (no locks); the tier data path under its lock.
"""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "guarded_protocol"]

log = logging.getLogger("ckptd.server")


class ConnectionLimits:
    """The shared bookkeeping of every connection of one server."""

    def __init__(
        self, max_connections: int, max_pending_per_client: int, request_timeout_s: float, token: str | None
    ) -> None:
        self.max_connections = max(1, max_connections)
        self.max_pending_per_client = max(1, max_pending_per_client)
        self.request_timeout_s = request_timeout_s
        self.token = token.encode() if token is not None else None
        self.open: set[Any] = set()
        self.pending: OrderedDict[Any, str] = OrderedDict()  # oldest first
        self.pending_by_client: dict[str, OrderedDict[Any, None]] = {}
        self.evicted = 0
        self.timed_out = 0
        self.refused = 0

    def admit(self, conn: Any, client: str) -> None:
        """Count a new connection; close the oldest pending ones over a cap (possibly ``conn``)."""
        self.open.add(conn)
        self.pending[conn] = client
        self.pending_by_client.setdefault(client, OrderedDict())[conn] = None
        mine = self.pending_by_client[client]
        while len(mine) > self.max_pending_per_client:
            self._evict(next(iter(mine)))
        while len(self.open) > self.max_connections and self.pending:
            self._evict(next(iter(mine if len(mine) > 1 else self.pending)))  # its own older one first
        if len(self.open) > self.max_connections and conn in self.open:
            self.refused += 1
            self._evict(conn)

    def known(self, conn: Any, headers: list[tuple[bytes, bytes]] | None) -> None:
        """``conn`` delivered a whole request: a known identity if it carried the token."""
        if conn not in self.pending:
            return
        if self.token is not None:
            auth = dict(headers or ()).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                return
        self.unpend(conn)

    def forget(self, conn: Any) -> None:
        self.open.discard(conn)
        self.unpend(conn)

    def unpend(self, conn: Any) -> None:
        """``conn`` is known (an authenticated request): never evicted from now on."""
        client = self.pending.pop(conn, None)
        if client is not None:
            mine = self.pending_by_client[client]
            mine.pop(conn, None)
            if not mine:
                del self.pending_by_client[client]

    def _evict(self, conn: Any) -> None:
        self.forget(conn)
        self.evicted += 1
        conn.transport.abort()  # RST: the descriptor is freed now, not after a lingering close


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, applying ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""

    class Guarded(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            limits.admit(self, self.client[0] if self.client else "")
            if not transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            limits.forget(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self._arm()  # a request under way: it has until the deadline to arrive whole
            else:
                self._disarm()
                limits.known(self, self.headers)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.request_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                limits.timed_out += 1
                log.debug(
                    "closing a connection from %s: no whole request in %.0f s", self.client, limits.request_timeout_s
                )
                self.transport.abort()

    return Guarded
