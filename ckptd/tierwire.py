"""The memory tier's data path on the wire: framing shared by the daemon (``ckptd.server.tierdata``)
and the restoring ranks (``trainer_hooks.tiered``), and ``ask_json`` for the tier routes' JSON
calls (``ckptd ls --daemon``, a restore's listings and reports). No dependency beyond the stdlib.

A frame is ``MAGIC`` (4 bytes) + the length of a JSON header (4 bytes, big endian) + the header;
a read reply's header is followed by exactly ``length`` bytes of body, and an ``fds`` reply's
header carries the descriptors (``SCM_RIGHTS``) with its first byte. The header length is checked
against ``MAX_HEADER`` before anything is allocated, its nesting against ``MAX_DEPTH`` (by a
loop over its brackets, before the JSON parser, which recurses, sees it), and a peer that closes
mid-frame is a ``WireError``: a frame is whole or it is an error, never a partial answer.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import socket
import struct

from ckptd.daemon_conn import DaemonConnection

__all__ = [
    "F_ADD_SEALS",
    "F_GET_SEALS",
    "MAX_DEPTH",
    "MAX_FDS",
    "MAX_HEADER",
    "SEALS",
    "REPLY",
    "REQUEST",
    "WireError",
    "ask_json",
    "recv_exact",
    "recv_frame",
    "send_frame",
]

REQUEST = b"CKTQ"
REPLY = b"CKTA"
MAX_HEADER = 1 << 20  # bytes of one frame's JSON header at most
MAX_FDS = 128  # descriptors one ``fds`` reply passes at most
MAX_JSON_REPLY = 256 << 20  # bytes of an ``ask_json`` reply at most, unless told
MAX_DEPTH = 8  # levels of nesting of a header at most (a read request's ranges: 3)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_HEAD = struct.Struct(">4sI")
F_ADD_SEALS, F_GET_SEALS = 1033, 1034  # fcntl commands (Linux)
SEALS = 0x0002 | 0x0004 | 0x0008  # F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE: a passed memfd is immutable


class WireError(Exception):
    """A malformed, oversized or cut-off frame: the connection is closed after it."""


def ask_json(
    url: str, token: str | None, timeout_s: float, method: str, path: str, body=None, cap=MAX_JSON_REPLY, vouch=None
):
    """The JSON object one request to the daemon at ``url`` answers, on a connection of its own.
    DaemonUnreachable (a CheckpointError) when it does not answer; ValueError for another status
    than 200 or a reply that is not a JSON object."""
    conn = DaemonConnection(url, token, timeout_s)
    conn.vouch = vouch
    try:
        status, _, raw = conn.fetch(method, path, body, cap)
    finally:
        conn.close()
    what = f"{method} {path.split('?')[0]} answered"
    if status != 200:
        raise ValueError(f"{what} {status}: {raw[:200]!r}")
    got = json.loads(raw)
    if not isinstance(got, dict):
        raise ValueError(f"{what} no object")
    return got


def send_frame(sock: socket.socket, magic: bytes, header: dict, fds: list[int] | None = None) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    data = memoryview(_HEAD.pack(magic, len(raw)) + raw)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if len(data):
        sock.sendall(data)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``recv_into``: no intermediate buffer); WireError if the
    peer closes first."""
    pos, n = 0, view.nbytes
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise WireError(f"the connection closed after {pos} of {n} bytes")
        pos += got


def recv_frame(sock: socket.socket, magic: bytes, max_fds: int = 0) -> tuple[dict, list[int]] | None:
    """One frame's header (and the descriptors passed with it, at most ``max_fds``; the caller
    owns and must close them); None when the peer closed cleanly before a frame began."""
    head = bytearray(_HEAD.size)
    fds: list[int] = []
    if max_fds:
        got, anc, flags, _ = sock.recvmsg(_HEAD.size, socket.CMSG_SPACE(max_fds * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[: len(data) - len(data) % a.itemsize])
                fds += list(a)
        if flags & socket.MSG_CTRUNC:
            _close(fds)
            raise WireError("more descriptors were passed than asked for")
        head[: len(got)] = got
        pos = len(got)
    else:
        pos = sock.recv_into(head)
    try:
        if pos == 0:
            return None
        if pos < len(head):
            recv_exact(sock, memoryview(head)[pos:])
        got_magic, n = _HEAD.unpack(head)
        if got_magic != magic:
            raise WireError("not a ckptd tier frame")
        if n > MAX_HEADER:
            raise WireError(f"a header of {n} bytes is over {MAX_HEADER}")
        raw = bytearray(n)
        recv_exact(sock, memoryview(raw))
        _check_depth(raw)
        try:
            header = json.loads(raw)
        except ValueError:
            raise WireError("the header is not JSON") from None
        if not isinstance(header, dict):
            raise WireError("the header is not a JSON object")
        return header, fds
    except BaseException:
        _close(fds)
        raise


def _check_depth(raw: bytearray) -> None:
    """WireError if the JSON text in ``raw`` nests deeper than ``MAX_DEPTH`` (strings, whose
    brackets are text, are skipped first)."""
    depth = 0
    for c in _STRING.sub(b"", raw).translate(None, _NOT_BRACKET):
        depth += 1 if c in b"[{" else -1
        if depth > MAX_DEPTH:
            raise WireError(f"the header nests more than {MAX_DEPTH} levels deep")


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
