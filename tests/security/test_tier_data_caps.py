"""Issue 36 item 4: idle connections without the token cannot lock trainers out of the memory
tier's data path (``ckptd.server.tierdata``). The attack: connections that never send a request
(or half a frame) opened to the data path's TCP port used to fill its one connection cap, shared
with its Unix socket, and a full cap refused newcomers; every rank's tier read got a 503 and fell
back to the job root, or failed. Now each listener has its own cap, a connection is *pending*
until a request with the token arrived, which it must within 2 s, and a full cap evicts the
oldest pending connection instead of refusing the newcomer; known connections are never evicted.

A daemon as the docs run it (a token, its own socket, no ``--trust-tcp``) holds a hot copy of a
saved step; its cap is lowered to 64 (``CKPTD_MAX_CONNECTIONS``) so that a flood of 96 fills it
(at the default, 1024, a flood of 1100 would do the same)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from urllib.parse import quote

import pytest

from ckptd.tierwire import REQUEST, send_frame
from tests.distributed import launch
from tests.server.daemon import node, wait_for
from tests.server.test_tier_data import _ask, _read, _refused, _tcp, _unix
from tests.server.test_tiers import TOKEN, _run, _url
from tests.server.test_tiers_batch import _object

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CAP = 64
FLOOD = 96


def _flood(port: int) -> list[socket.socket]:
    """``FLOOD`` connections without the token: most send nothing, every third half a frame."""
    socks = []
    for i in range(FLOOD):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        if i % 3 == 0:
            s.sendall(struct.pack(">4sI", REQUEST, 100) + b'{"op":')
        socks.append(s)
    return socks


def _closed_within(s: socket.socket, bound_s: float) -> bool:
    """True if the daemon ends ``s`` (EOF or reset; an error reply may come first) within ``bound_s``."""
    s.settimeout(bound_s)
    end = time.monotonic() + bound_s
    try:
        while time.monotonic() < end:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def test_idle_connections_without_the_token_cannot_lock_out_tier_reads(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    d = node(tmp_path, "a", root, port, [_url(port)], trust_tcp=False, CKPTD_MAX_CONNECTIONS=str(CAP))
    flood: list[socket.socket] = []
    known: list[socket.socket] = []
    try:
        _run(1, "save_steps", tmp_path / "s", daemons=[d.socket_url], root=root, steps=[1])
        code, body = d.get(f"/v1/tiers?root={quote(root, safe='')}&step=1", TOKEN)
        assert code == 200 and [h["step"] for h in body["hot"]] == [1], body
        attempt, data = body["hot"][0]["attempt"], body["data"]
        code, body = d.get(f"/v1/tiers?root={quote(root, safe='')}&step=1&attempt={attempt}&keys=true", TOKEN)
        ranges = [[k, 0, n] for k, n in sorted(body["hot"][0]["keys"].items())[:32]]  # whole objects
        want = b"".join(_object(d.url, root, 1, attempt, *r) for r in ranges)
        request = {"op": "read", "ranges": ranges, "root": root, "step": 1, "attempt": attempt}

        def read(sock: socket.socket) -> None:
            reply = _ask(sock, **request)
            assert reply == {"ok": True, "step": 1, "attempt": attempt, "length": len(want)}, reply
            assert _read(sock, len(want)) == want  # bitwise the held bytes

        # The flood fills the TCP cap; the step is still read on the socket and over TCP.
        flood = _flood(data["port"])
        with _unix(data) as s:
            read(s)
        with _tcp(data) as s:
            read(s)
        assert d.metric("ckptd_tier_data_evicted", TOKEN) > 0
        assert d.metric("ckptd_tier_data_connections", TOKEN) <= 2 * CAP

        # A pending connection is closed about 2 s after it connected (bound: 10 s).
        with _tcp(data) as s:
            assert _closed_within(s, 10.0)

        # Known connections (a read with the token) fill the TCP cap and are never evicted: a
        # TCP newcomer is refused, the socket's own cap still admits a reader.
        for _ in range(CAP):
            known.append(_tcp(data))
            read(known[-1])
        _refused(_tcp(data), 503)
        with _unix(data) as s:
            read(s)
        for s in known:
            read(s)  # still open, still served
        wait_for(lambda: d.healthy(), "the daemon", 30)
    finally:
        for s in flood + known:
            with contextlib.suppress(OSError):
                s.close()
        d.kill()


def test_one_address_or_uid_holds_few_pending_connections(tmp_path):
    """``CKPTD_MAX_PENDING_PER_CLIENT`` (4 here) bounds the pending connections of one address on
    the TCP port and of one uid on the Unix socket: a fifth evicts that client's oldest."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    d = node(tmp_path, "a", root, port, [_url(port)], trust_tcp=False, CKPTD_MAX_PENDING_PER_CLIENT="4")
    socks: list[socket.socket] = []
    try:
        data = d.get("/v1/tiers", TOKEN)[1]["data"]
        for connect in (_tcp, _unix):
            socks += [connect(data) for _ in range(10)]
        wait_for(lambda: d.metric("ckptd_tier_data_evicted", TOKEN) >= 12, "6 evicted per listener", 30)
        assert d.metric("ckptd_tier_data_connections", TOKEN) <= 8  # 4 per listener (fewer: timed out)
        for oldest in (socks[0], socks[10]):
            assert _closed_within(oldest, 10.0)
        for connect in (_tcp, _unix):
            s = connect(data)
            send_frame(s, REQUEST, {"token": "wrong"})
            _refused(s, 401)  # a newcomer is admitted and answered
    finally:
        for s in socks:
            s.close()
        d.kill()
