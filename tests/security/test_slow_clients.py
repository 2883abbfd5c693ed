"""Issue 27 item 7: slow and idle clients cannot starve the daemon. A flood of half-open
connections (some send nothing, some one header line) larger than the daemon's open-files limit
used to leave ``/healthz`` and every trainer's hand-off unanswered; now the oldest pending
connections are evicted to make room, a request must arrive whole within its deadline, and a
health check and a real hand-off (``Checkpointer(daemon=...)``) go through during the flood.

The daemon starts with a soft open-files limit of 256 (the flood is 300 connections: modest, on
loopback) and ``CKPTD_MAX_CONNECTIONS=64``, so the cap, not a large limit, is what holds."""

from __future__ import annotations

import contextlib
import resource
import socket
import urllib.request

import pytest

from ckptd import catalog
from storage_backends import open_store
from tests.security.conftest import small_state
from tests.server.daemon import Daemon
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FLOOD = 300
CAP = 64


@contextlib.contextmanager
def _soft_nofile(n: int):
    """Children started inside inherit a soft open-files limit of ``n``."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, old[1]), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def _flood(port: int, n: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        if i % 2:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # a header line, then nothing: slowloris
        socks.append(s)
    return socks


def test_half_open_connections_do_not_starve_health_checks_or_hand_offs(tmp_path):
    root = str(tmp_path / "jobs")
    d = Daemon(
        [root],
        tmp_path / "staging",
        tmp_path / "daemon.log",
        CKPTD_MAX_CONNECTIONS=str(CAP),
        CKPTD_MAX_PENDING_PER_CLIENT=str(CAP),
        CKPTD_REQUEST_TIMEOUT_S="5",
    )
    with _soft_nofile(256):
        d.start()
    socks: list[socket.socket] = []
    try:
        socks = _flood(d.port, FLOOD)
        with urllib.request.urlopen(d.url + "/healthz", timeout=30) as r:
            assert r.status == 200
        with Checkpointer(root + "/run", daemon=d.socket_url) as ck:
            assert ck.save(1, small_state(1)).result().committed_here
        socks += _flood(d.port, FLOOD)  # a second wave, while the trainer's connection is known
        with Checkpointer(root + "/run", daemon=d.socket_url) as ck:
            assert ck.save(2, small_state(2)).result().committed_here
        assert catalog.committed_steps(open_store(root + "/run")) == [1, 2]
        # every flooding connection but at most CAP was closed by the daemon: evicted to make
        # room, or timed out (those of the first wave still pending when the second came)
        closed = d.metric("ckptd_connections_evicted") + d.metric("ckptd_connections_timed_out")
        assert closed >= 2 * FLOOD - CAP
        assert d.metric("ckptd_connections_evicted") > 0
        assert d.metric("ckptd_connections") <= CAP
    finally:
        for s in socks:
            s.close()
        d.stop()


def test_a_request_that_never_finishes_is_closed(tmp_path):
    d = Daemon([str(tmp_path / "jobs")], tmp_path / "staging", tmp_path / "daemon.log", CKPTD_REQUEST_TIMEOUT_S="1")
    with d:
        auth = f"Authorization: Bearer {d.token}\r\n".encode()  # a caller with the token: no early 401
        for first in (
            b"",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\n",
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 9\r\n\r\n{",
        ):
            with socket.create_connection(("127.0.0.1", d.port), timeout=60) as s:
                s.sendall(first)
                try:
                    got = s.recv(4096)  # blocks until the daemon gives up on the request
                except ConnectionResetError:
                    got = b""
                assert got == b"", (first, got)
        assert d.metric("ckptd_connections_timed_out") == 3
