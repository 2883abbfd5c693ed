"""The read side of one daemon's memory tier (``TierStore``) for ``trainer_hooks.tiered``.

Transport, nearest first: the rank's own daemon lends its sealed buffers over the Unix socket
(SCM_RIGHTS; mapped ``PROT_READ``, the seals checked before use, no byte over a socket); a peer
answers on its threaded data path (``ckptd.tierwire``; replies read straight into the
destination buffers); the HTTP tier routes are the fallback. A reply that does not name the step
and attempt asked for or carry exactly the bytes asked for is ``TierUnavailable``: the caller
skips the tier (its trust rule: ``trainer_hooks.tiered``).
"""

from __future__ import annotations

import http.client
import logging
import mmap
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from urllib.parse import quote

import numpy as np

from ckptd.daemon_conn import DaemonConnection, DaemonUnreachable, unix_address
from ckptd.tierwire import F_GET_SEALS, MAX_FDS, REPLY, REQUEST, SEALS, WireError, recv_exact, recv_frame, send_frame
from storage_backends.base import as_writable_buffers

__all__ = ["BATCH_BYTES", "DEFAULT_TIER_TIMEOUT_S", "TierStore", "TierUnavailable"]

log = logging.getLogger("ckptd.tiered")

DEFAULT_TIER_TIMEOUT_S = 10.0  # a peer slower than this per request is skipped (CKPTD_TIER_TIMEOUT_S)
# Shard-object bytes one batched tier read asks for (at most one object more).
BATCH_BYTES = int(os.environ.get("CKPTD_TIER_BATCH_BYTES", 4 << 20))


class TierUnavailable(Exception):  # noqa: N818 - not a StorageError: the reader must not turn it into a bad chunk
    """A tier did not answer, or answered something other than the committed bytes: the tier is
    skipped for the rest of the restore."""


class _RangeReads:
    """``get_range`` and ``get_ranges`` through the class's ``get_range_into``."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        buf = bytearray(length)
        self.get_range_into(key, start, [buf])  # type: ignore[attr-defined]
        return bytes(buf)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.get_range(key, s, n) for s, n in ranges]


class _Fetched(_RangeReads):
    """Ranges of shard objects already fetched from one tier (``TieredReader.read``), shaped
    like the ``Store`` methods ``CheckpointReader`` reads chunks with; a range it does not hold
    is ``TierUnavailable`` (the shard is then read from the next tier)."""

    batched = False  # the bytes are here: nothing to batch

    def __init__(self, name: str):
        self.name = name
        self.held: dict[str, tuple[int, memoryview]] = {}

    def close(self) -> None:
        """Forget the held views (a mapping is unmapped once no tensor copy reads from it)."""
        self.held = {}

    def _view(self, key: str, start: int, length: int) -> memoryview:
        begin, mv = self.held.get(key, (0, None))
        if start < 0 and begin == 0 and mv is not None:
            start += len(mv)  # from the end of a whole object (a shard index)
        if mv is None or start < begin or start + length > begin + len(mv):
            raise TierUnavailable(f"{self.name}: {key} {start}+{length} was not fetched")
        return mv[start - begin : start - begin + length]

    def get_range_into(self, key: str, start: int, buffers) -> None:
        views = as_writable_buffers(buffers)
        data = np.frombuffer(self._view(key, start, sum(v.nbytes for v in views)), np.uint8)
        pos = 0
        for v in views:
            np.frombuffer(v, np.uint8)[:] = data[pos : pos + v.nbytes]  # numpy copies without the GIL
            pos += v.nbytes


class TierStore(_RangeReads):
    """The read side of one daemon's memory tier for one (root, step, attempt), shaped like the
    ``Store`` methods ``CheckpointReader`` reads chunks with."""

    def __init__(self, url: str, name: str, root: str, step: int, attempt: str, token: str | None, timeout_s: float):
        self._http = DaemonConnection(url, token, timeout_s)
        self.url, self.name, self.uri = self._http.url, name, url
        self.root, self.step, self.attempt = root, step, attempt
        self._token = token
        self.timeout_s = timeout_s
        # The data path (``ckptd.server.tierdata``), as the keys reply advertises it: the TCP port
        # on this daemon's host, and the Unix socket when this is the rank's own node's daemon.
        self.data_port: int | None = None
        self.data_socket: str | None = None
        self.vouch: Callable[[], str | None] | None = None  # this rank's ticket (``TieredRestore.ticket``)
        self._local = threading.local()
        self._conns: list = []  # every thread's data-path socket, closed by close()
        self._conns_lock = threading.Lock()

    # Small objects are fetched in batches on either path: one request (HTTP or data path) per
    # batch costs less than one per object, even on the data path (measured: the tiers benchmark).
    batched = True

    def use_data(self, data, unix: bool) -> None:
        """Read through the advertised data path ``data`` ({"port", "socket"}); its Unix socket
        only when ``unix`` (this node's own daemon)."""
        if not isinstance(data, dict):
            return
        port, path = data.get("port"), data.get("socket")
        if type(port) is int and 0 < port < 65536 and self._http.host is not None:
            self.data_port = port
        if unix and isinstance(path, str) and os.path.isabs(path) and sys.platform.startswith("linux"):
            self.data_socket = path

    def close(self) -> None:
        """Close every thread's connection (a restore ends with its tiers)."""
        self._http.close()
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _data_conn(self, unix: bool) -> socket.socket:
        """This thread's connection to the data path (kept open across requests)."""
        name = "dunix" if unix else "dtcp"
        sock = getattr(self._local, name, None)
        if sock is None:
            if unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout_s)
                    with unix_address(self.data_socket) as address:  # a path past 108 bytes too
                        sock.connect(address)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self._http.host, self.data_port), timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setattr(self._local, name, sock)
            with self._conns_lock:
                self._conns.append(sock)
        return sock

    def _data_call(self, header: dict, unix: bool, max_fds: int = 0) -> tuple[socket.socket, dict, list[int]]:
        """Send one request on the data path; return the connection and the checked reply header
        (and descriptors). Any failure drops the connection: TierUnavailable."""
        try:
            sock = self._data_conn(unix)
            req = {"token": self._token, "root": self.root, "step": self.step, "attempt": self.attempt, **header}
            req |= {"vouch": vouch} if self.vouch and not unix and (vouch := self.vouch()) else {}
            send_frame(sock, REQUEST, req)
            got = recv_frame(sock, REPLY, max_fds)
            if got is None:
                raise WireError("the daemon closed the connection")
            reply, fds = got
        except (OSError, WireError) as e:
            raise self._data_failed(unix, e) from None
        if reply.get("ok") is not True or reply.get("step") != self.step or reply.get("attempt") != self.attempt:
            for fd in fds:
                os.close(fd)
            self._drop_data(unix)
            why = reply.get("detail") if reply.get("ok") is not True else "another step or attempt"
            raise TierUnavailable(f"{self.name}: data path answered {reply.get('status')}: {str(why)[:200]}")
        return sock, reply, fds

    def _data_failed(self, unix: bool, e: Exception) -> TierUnavailable:
        """The connection broke (``e``): it is dropped, and the error to raise."""
        self._drop_data(unix)
        return TierUnavailable(f"{self.name}: data path: {e or type(e).__name__}")

    def _drop_data(self, unix: bool) -> None:
        name = "dunix" if unix else "dtcp"
        sock = getattr(self._local, name, None)
        if sock is not None:
            sock.close()
            setattr(self._local, name, None)

    def _data_read(self, ranges: Sequence[tuple[str, int, int]], views: list[memoryview]) -> None:
        """The bytes of ``ranges``, concatenated, received straight into ``views`` (exactly as
        many bytes as they hold)."""
        unix = self.data_socket is not None
        length = sum(v.nbytes for v in views)
        sock, reply, _ = self._data_call({"op": "read", "ranges": [list(r) for r in ranges]}, unix)
        if reply.get("length") != length:
            self._drop_data(unix)
            raise TierUnavailable(f"{self.name}: {reply.get('length')} bytes where {length} were asked")
        try:
            for v in views:
                recv_exact(sock, v)
        except (OSError, WireError) as e:
            raise self._data_failed(unix, e) from None

    def map_objects(self, keys: Sequence[str]) -> _Fetched:
        """Every object of ``keys`` mapped read-only from the sealed memory the daemon passes
        on its Unix data socket (``SCM_RIGHTS``): no byte crosses a socket. The descriptors must
        carry the seals (nobody can change the memory while this rank reads it); the chunks are
        still checked against their crc32c when read."""
        import fcntl

        mapped = _Fetched(f"{self.name} (shared memory)")
        keys = list(keys)
        try:
            for i in range(0, len(keys), MAX_FDS):
                part = keys[i : i + MAX_FDS]
                _, reply, fds = self._data_call({"op": "fds", "keys": part}, True, max_fds=len(part))
                try:
                    sizes = reply.get("sizes")
                    if not isinstance(sizes, list) or len(sizes) != len(part) or len(fds) != len(part):
                        raise TierUnavailable(f"{self.name}: {len(fds)} descriptors for {len(part)} objects")
                    for key, size, fd in zip(part, sizes, fds, strict=True):
                        if type(size) is not int or size <= 0 or os.fstat(fd).st_size != size:
                            raise TierUnavailable(f"{self.name}: {key}: descriptor of another size than {size}")
                        if fcntl.fcntl(fd, F_GET_SEALS) & SEALS != SEALS:
                            raise TierUnavailable(f"{self.name}: {key}: memory not sealed against writes")
                        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                        mapped.held[key] = (0, memoryview(m))
                finally:
                    for fd in fds:
                        os.close(fd)
        except OSError as e:
            mapped.close()
            raise TierUnavailable(f"{self.name}: cannot map the shared copy: {e}") from None
        except BaseException:
            mapped.close()
            raise
        return mapped

    def _object_path(self, key: str, start: int, length: int) -> str:
        q = f"root={quote(self.root, safe='')}&step={self.step}&attempt={quote(self.attempt, safe='')}"
        return f"/v1/tiers/object?{q}&key={quote(key, safe='')}&start={start}&length={length}"

    def _http_read(self, path: str, body, views: list[memoryview], what: str) -> None:
        """One request about ``what`` (a POST of ``body`` when given); its reply must be a 200 of
        the step and attempt asked with exactly the bytes ``views`` hold, and its body is read
        straight into them. On any failure the connection is dropped (unread): TierUnavailable."""
        length = sum(v.nbytes for v in views)
        try:
            conn, resp = self._http.send("POST" if body is not None else "GET", path, body)
        except DaemonUnreachable as e:
            raise TierUnavailable(f"{self.name}: {e}") from None
        try:
            got = resp.getheader("Content-Length")
            if got is None or not got.isdigit() or int(got) > length:
                raise TierUnavailable(f"{self.name}: reply of {got} bytes where at most {length} were asked")
            if resp.status != 200:
                raise TierUnavailable(f"{self.name}: {what} answered {resp.status}")
            if resp.getheader("X-Ckptd-Step") != str(self.step) or resp.getheader("X-Ckptd-Attempt") != self.attempt:
                raise TierUnavailable(f"{self.name}: {what} came from another step or attempt than the commit record's")
            if int(got) != length:
                raise TierUnavailable(f"{self.name}: {what}: {got} bytes where {length} were asked")
            for v in views:
                pos = 0
                while pos < v.nbytes:
                    n = resp.readinto(v[pos:])
                    if not n:
                        raise TierUnavailable(f"{self.name}: {what}: the reply ended early")
                    pos += n
        except TierUnavailable:
            self._http.drop(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._http.drop(conn)
            raise TierUnavailable(f"{self.name}: {e or type(e).__name__}") from None

    def get_range_into(self, key: str, start: int, buffers) -> None:
        """One GET (or one data-path request) for the whole range, its body read straight into
        ``buffers`` (no intermediate copy); the connection stays open for this thread's next read."""
        views = as_writable_buffers(buffers)
        length = sum(v.nbytes for v in views)
        if self.data_port is not None or self.data_socket is not None:
            self._data_read([(key, start, length)], views)
        else:
            self._http_read(self._object_path(key, start, length), None, views, key)

    def get_batch(self, ranges: Sequence[tuple[str, int, int]]) -> bytearray:
        """The bytes of ``ranges`` ((key, start, length) each), concatenated: one POST
        ``/v1/tiers/read`` (or one data-path request), its body read straight into one buffer."""
        out = bytearray(sum(n for _, _, n in ranges))
        if self.data_port is not None or self.data_socket is not None:
            self._data_read(ranges, [memoryview(out)])
        else:
            body = {"root": self.root, "step": self.step, "attempt": self.attempt}
            body["ranges"] = [{"key": k, "start": st, "length": n} for k, st, n in ranges]
            self._http_read("/v1/tiers/read", body, [memoryview(out)], f"a batch of {len(ranges)} ranges")
        return out
