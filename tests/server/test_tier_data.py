"""The memory tier's data path (``ckptd.server.tierdata``) with a real daemon holding a real hot
copy: the bytes it answers are the HTTP route's; hostile requests (no or a wrong token, oversized
or malformed frames, unknown or path-like keys, ranges outside an object, a half-closed
connection) get one error and a closed connection, and the daemon keeps serving; the sealed
memory passed on its Unix socket cannot be changed by the rank that receives it; a restore
through the node's own daemon maps that memory (no byte over a socket), bitwise."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import struct
from pathlib import Path
from urllib.parse import quote

import pytest

from ckptd.tierwire import F_GET_SEALS, MAX_HEADER, REPLY, REQUEST, SEALS, recv_frame, send_frame
from tests.distributed import launch
from tests.server.daemon import node as _daemon
from tests.server.daemon import wait_for
from tests.server.test_tiers import TOKEN, _check, _run, _tiers, _url
from tests.server.test_tiers_batch import _object

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """A daemon whose hot copy holds step 1 of a 1-rank job: (daemon, root, attempt, keys, out)."""
    tmp = tmp_path_factory.mktemp("tierdata")
    (tmp / "token").write_text(TOKEN)
    os.chmod(tmp / "token", 0o600)
    root = f"file://{tmp / 'job'}"
    port = launch.free_port()
    d = _daemon(tmp, "a", root, port, [_url(port)])
    try:
        _run(1, "save_steps", tmp / "s", daemons=[d.socket_url], root=root, steps=[1])
        hot = _tiers(d)["hot"]
        assert [h["step"] for h in hot] == [1], hot
        attempt = hot[0]["attempt"]
        code, body = d.get(f"/v1/tiers?root={quote(root, safe='')}&step=1&attempt={attempt}&keys=true", TOKEN)
        assert code == 200 and body["data"]["port"] > 0, body
        yield d, root, attempt, sorted(body["hot"][0]["keys"]), body["data"], tmp
    finally:
        d.kill()


def _tcp(data: dict) -> socket.socket:
    return socket.create_connection(("127.0.0.1", data["port"]), timeout=30)


def _unix(data: dict) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(data["socket"])
    return s


def _ask(sock: socket.socket, **header) -> dict:
    send_frame(sock, REQUEST, {"token": TOKEN, **header})
    got = recv_frame(sock, REPLY)
    assert got is not None
    return got[0]


def _refused(sock: socket.socket, status: int) -> None:
    """One error reply of ``status``, then the daemon closes the connection."""
    got = recv_frame(sock, REPLY)
    assert got is not None and got[0]["ok"] is False and got[0]["status"] == status, got
    assert sock.recv(1) == b""  # closed: nothing more, ever
    sock.close()


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the reply ended early"
        out += chunk
    return bytes(out)


def test_data_path_answers_the_held_bytes_and_refuses_hostile_input(held):
    d, root, attempt, keys, data, _ = held
    base = {"root": root, "step": 1, "attempt": attempt}
    ranges = [[k, i, 9] for i, k in enumerate(keys[:3])] + [[keys[0], -4, 4]]
    want = b"".join(_object(d.url, root, 1, attempt, k, st, n) for k, st, n in ranges)

    # The same bytes as the HTTP route, two requests on one connection (kept open).
    with _tcp(data) as s:
        for _ in range(2):
            reply = _ask(s, op="read", ranges=ranges, **base)
            assert reply == {"ok": True, "step": 1, "attempt": attempt, "length": len(want)}, reply
            assert _read(s, len(want)) == want

    def refused(status: int, sock=None, **header) -> None:
        sock = sock or _tcp(data)
        send_frame(sock, REQUEST, header)
        _refused(sock, status)

    good = {"op": "read", "ranges": ranges, **base}
    refused(401, **good)  # no token
    refused(401, token="wrong-token", **good)
    refused(401, token=TOKEN + "x", **good)
    refused(400, token=TOKEN, **{**good, "root": "file:///etc"})  # a root not served
    refused(400, token=TOKEN, **{**good, "step": "1"})
    refused(400, token=TOKEN, **{**good, "ranges": []})
    refused(400, token=TOKEN, **{**good, "ranges": [["k", 0]]})
    refused(400, token=TOKEN, **{**good, "op": "write"})
    refused(404, token=TOKEN, **{**good, "ranges": [["step_0000000001/arrays/../../../etc/passwd", 0, 1]]})
    refused(404, token=TOKEN, **{**good, "ranges": [["/etc/passwd", 0, 1]]})
    refused(404, token=TOKEN, **{**good, "attempt": "other"})
    refused(404, token=TOKEN, **{**good, "step": 2})
    refused(416, token=TOKEN, **{**good, "ranges": [[keys[0], 0, 1 << 40]]})
    refused(416, token=TOKEN, **{**good, "ranges": [[keys[0], -(1 << 40), 4]]})
    refused(416, token=TOKEN, **{**good, "ranges": [[keys[0], 0, -1]]})
    refused(400, token=TOKEN, **{**good, "op": "fds", "keys": keys[:1]})  # descriptors: Unix socket only

    # Frames: an oversized header length (nothing allocated), another protocol, a cut-off frame.
    s = _tcp(data)
    s.sendall(struct.pack(">4sI", REQUEST, MAX_HEADER + 1))
    _refused(s, 400)
    s = _tcp(data)
    s.sendall(struct.pack(">4sI", REQUEST, 0xFFFFFFFF))
    _refused(s, 400)
    s = _tcp(data)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _refused(s, 400)
    s = _tcp(data)
    s.sendall(struct.pack(">4sI", REQUEST, 5) + b"[1,2]")
    _refused(s, 400)
    s = _tcp(data)
    s.sendall(struct.pack(">4sI", REQUEST, 100) + b'{"op":')
    s.shutdown(socket.SHUT_WR)  # half-closed mid-frame
    _refused(s, 400)
    s = _tcp(data)
    s.sendall(REQUEST[:2])
    s.shutdown(socket.SHUT_WR)
    _refused(s, 400)

    # The daemon is still up and the data path still answers the right bytes.
    assert d.healthy()
    with _tcp(data) as s:
        assert _ask(s, op="read", ranges=ranges, **base)["ok"] is True
        assert _read(s, len(want)) == want


def test_passed_memory_is_sealed_against_the_reader(held):
    d, root, attempt, keys, data, _ = held
    key = keys[0]
    with _unix(data) as s:
        send_frame(
            s, REQUEST, {"token": TOKEN, "op": "fds", "keys": [key], "root": root, "step": 1, "attempt": attempt}
        )
        got = recv_frame(s, REPLY, max_fds=4)
    assert got is not None
    reply, fds = got
    assert reply["ok"] is True and len(fds) == 1, reply
    fd = fds[0]
    try:
        n = reply["sizes"][0]
        before = _object(d.url, root, 1, attempt, key, 0, n)
        assert os.fstat(fd).st_size == n
        with mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            assert bytes(m) == before  # the held bytes, read without a socket

        import fcntl

        assert fcntl.fcntl(fd, F_GET_SEALS) & SEALS == SEALS
        # Every way to change it through the descriptor is refused by the kernel.
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"\xff" * 8, 0)
        assert e.value.errno == errno.EPERM
        for size in (0, n - 1, n + 4096):
            with pytest.raises(OSError) as e:
                os.ftruncate(fd, size)
            assert e.value.errno == errno.EPERM
        with pytest.raises(OSError) as e:
            mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert e.value.errno == errno.EPERM
        fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # nor through a writable reopening
        try:
            with pytest.raises(OSError) as e:
                os.write(fd2, b"\xff")
            assert e.value.errno == errno.EPERM
        finally:
            os.close(fd2)
    finally:
        os.close(fd)
    assert _object(d.url, root, 1, attempt, key, 0, n) == before  # the daemon's copy is unchanged


def test_restore_through_own_daemon_maps_its_memory(held):
    d, root, attempt, keys, data, tmp = held
    out: Path = tmp / "r"
    before = d.metric("ckptd_tier_object_requests_total", TOKEN)
    served = d.metric("ckptd_tier_bytes_served_total", TOKEN)
    shared = d.metric("ckptd_tier_bytes_shared_total", TOKEN)
    res = _run(1, "restore_tiered", out, {}, daemon=d.socket_url, root=root, ref=str(tmp / "s" / "ref_step1.pt"))
    got = _check(res, 1)
    assert got["root"] == 0 and got["local"] > 0 and got["peer"] == 0, got
    # one descriptor request per 128 objects: no request carried the objects' bytes
    asked = d.metric("ckptd_tier_object_requests_total", TOKEN) - before
    assert asked == -(-len(keys) // 128), (asked, len(keys))
    # every byte it lent was sealed memory: none went over a socket
    lent = d.metric("ckptd_tier_bytes_shared_total", TOKEN) - shared
    assert lent > 0 and d.metric("ckptd_tier_bytes_served_total", TOKEN) - served == lent, lent


def test_data_connections_are_capped(tmp_path):
    """Over the cap (3) the oldest idle connection without the token is closed to admit a
    newcomer, whose request is then answered (the daemon stays up); the count stays at the cap.
    Known connections, which the caps never evict, are tests/security/test_tier_data_caps.py's."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    d = _daemon(tmp_path, "a", root, port, [_url(port)], CKPTD_MAX_CONNECTIONS="3")
    try:
        data = _tiers(d)["data"]
        held = [_tcp(data) for _ in range(3)]  # admitted, idle: pending
        wait_for(lambda: d.metric("ckptd_tier_data_connections", TOKEN) == 3, "3 data connections", 30)
        s = _tcp(data)
        assert held[0].recv(1) == b""  # the oldest, evicted for the newcomer
        send_frame(s, REQUEST, {"token": "wrong"})
        _refused(s, 401)  # admitted
        assert d.healthy() and d.metric("ckptd_tier_data_connections", TOKEN) <= 3
        assert d.metric("ckptd_tier_data_evicted", TOKEN) >= 1
        for h in held:
            h.close()
    finally:
        d.kill()
