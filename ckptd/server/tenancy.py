"""Who calls the daemon, and what each caller may touch (docs/security.md, "The daemon knows who
calls" and the rules after it).

The token, shared by every trainer of the node, cannot tell callers apart. The kernel can: the
daemon also listens on a Unix socket (``--socket``, mode 0666) and reads each connection's
``SO_PEERCRED``, which the caller cannot forge. ``peer_protocol`` puts it into each request's
``scope["state"]`` (uvicorn copies the protocol's ``app_state`` into it); a TCP connection carries
none. Operators (uid 0, the daemon's uid, trusted TCP callers) may do everything; leases and
hand-offs need an identity and are their creator's; a job root belongs to its first writer
(``bindings.json``) or to ``--bind ROOT=USER``, and to bind a local root a caller must be able to
write it by its mode bits, so the daemon never writes where its caller could not.

The bindings file, in the daemon's own staging folder, is written through a fresh ``O_EXCL |
O_NOFOLLOW`` file renamed into place and read with ``O_NOFOLLOW``, a size cap and an owner check;
an unreadable one stops the daemon at start (failing closed: a daemon that forgot its bindings
would hand roots to the next caller).

A replica carries its root's binding from the daemon that pushed it (signed with the peer key:
``server.peers.peer_sender``); while this daemon holds it (``carried``), that root is bound here
to that uid as well, in memory only; a replica whose binding conflicts with this daemon's own is
refused (``carry``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote, unquote

from ckptd.daemon_conn import VOUCH_HEADER, VOUCH_S, unix_address
from ckptd.server.roots import RootError, innermost, inside, normalize
from ckptd.server.safefiles import StagingError, check_ancestors, open_private_dir, read_staged, write_json_atomic

__all__ = [
    "BINDINGS_FILE",
    "Caller",
    "Forbidden",
    "PEER_KEY",
    "Peer",
    "SOCKET_NAME",
    "Tenancy",
    "can_isolate",
    "listen_unix",
    "parse_bind",
    "peer_of",
    "peer_protocol",
    "release_unix",
]

log = logging.getLogger("ckptd.tenancy")

PEER_KEY = "ckptd_peer"
SOCKET_NAME = "ckptd.sock"
BINDINGS_FILE = "bindings.json"
MAX_BINDINGS_BYTES = 4 << 20
_CAP_CHOWN, _CAP_DAC_OVERRIDE = 0, 1
T = TypeVar("T")


class Forbidden(Exception):
    """The caller may not touch this lease, job or root: HTTP 403."""


@dataclass(frozen=True)
class Peer:
    """What the kernel says about the process at the other end of a Unix socket connection."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Caller:
    peer: Peer | None  # None: a TCP connection, which names nobody
    operator: bool
    # a TCP reader named by its own daemon's ticket (``Tenancy.vouched``): the one root it reads
    vouched: tuple | None = None

    @property
    def uid(self) -> int | None:
        return self.peer.uid if self.peer is not None else None

    def __str__(self) -> str:
        if self.peer is None or self.vouched:
            return "a TCP caller" + (f" vouched for as uid {self.peer.uid}" if self.peer else "")
        return f"uid {self.peer.uid} ({_user_name(self.peer.uid)}, pid {self.peer.pid})"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def peer_of(sock: socket.socket | None) -> Peer | None:
    """What the kernel says (``SO_PEERCRED``) about the other end of ``sock`` if it is a Unix socket."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    return Peer(*struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))))


def peer_protocol(base: type) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that reads ``SO_PEERCRED`` once per
    Unix socket connection into the state every request of that connection sees."""

    class PeerCredProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            state = {k: v for k, v in self.app_state.items() if k != PEER_KEY}
            if (peer := peer_of(transport.get_extra_info("socket"))) is not None:
                state[PEER_KEY] = peer
            self.app_state = state  # per connection: uvicorn copies it into each request's scope
            super().connection_made(transport)

    PeerCredProtocol.__name__ = f"PeerCred{base.__name__}"
    return PeerCredProtocol


_LOCKS: dict[Path, int] = {}  # socket path -> the lock this process holds on it while it listens


def listen_unix(path: Path, folder_mode: int = 0o700, gid: int | None = None) -> socket.socket:
    """A Unix socket bound at ``path``, mode 0666 (whoever may enter its folder may connect; the
    kernel names them). The folder is created with ``folder_mode`` (and group ``gid``) if
    missing; it must not be a link, and it and every folder above must belong to root or this
    daemon's user and not be writable by others unless sticky (``check_ancestors``), so nobody
    else can swap or plant the socket. ``<path>.lock`` stays locked while this process listens
    (``release_unix``): a second daemon on a live daemon's socket is refused; a socket a dead
    daemon of this user left is replaced; anything else is refused."""
    path = Path(path)
    if not os.path.lexists(path.parent):
        os.close(open_private_dir(path.parent, folder_mode, gid))
    if os.path.islink(path.parent):
        raise StagingError(f"socket folder {path.parent} is a symbolic link: refusing it")
    check_ancestors(path)
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(lock).st_uid != os.geteuid():
            raise StagingError(f"{path}.lock belongs to another user: refusing the socket {path}")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise StagingError(f"socket path {path} exists and is not a socket of this daemon's user: refusing it")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except BlockingIOError:
        os.close(lock)
        raise StagingError(
            f"another ckptd serve listens on {path}: stop it, or give this daemon a socket of its own "
            "(--socket PATH or CKPTD_SOCKET)"
        ) from None
    except BaseException:
        os.close(lock)
        raise
    try:
        with unix_address(path) as address:
            sock.bind(address)
        os.chmod(path, 0o666)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        os.close(lock)
        raise
    _LOCKS[path] = lock
    return sock


def release_unix(path: Path) -> None:
    """Remove the socket ``listen_unix`` bound at ``path`` and release its lock."""
    path = Path(path)
    with contextlib.suppress(OSError):
        os.unlink(path)
    lock = _LOCKS.pop(path, None)
    if lock is not None:
        os.close(lock)


def can_isolate() -> bool:
    """True when this process may give lease folders to other users and still read and delete
    what they stage there: ``CAP_CHOWN`` and ``CAP_DAC_OVERRIDE`` (root has both)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        return os.geteuid() == 0
    need = (1 << _CAP_CHOWN) | (1 << _CAP_DAC_OVERRIDE)
    return caps & need == need


def parse_bind(text: str) -> tuple[str, int]:
    """``ROOT=USER`` (a user name or uid) -> (root, uid); ValueError when malformed."""
    root, sep, user = text.rpartition("=")
    if not sep or not root or not user:
        raise ValueError(f"--bind {text!r}: expected ROOT=USER")
    try:
        uid = int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ValueError(f"--bind {text!r}: no such user {user!r}") from None
    normalize(root)
    return root, uid


def _may_write(uid: int, gids: set[int], st: os.stat_result) -> bool:
    """Whether ``uid`` (with groups ``gids``) may create names in the folder ``st``, by its mode
    bits (write and search), as the kernel decides for a process without capabilities."""
    shift = 6 if st.st_uid == uid else 3 if st.st_gid in gids else 0  # owner, group or other bits
    return uid == 0 or (st.st_mode >> shift) & 0o3 == 0o3


def _groups(peer: Peer) -> set[int]:
    try:
        return {peer.gid, *os.getgrouplist(pwd.getpwuid(peer.uid).pw_name, peer.gid)}
    except KeyError:
        return {peer.gid}


class Tenancy:
    """The callers' rights: operators, lease owners, job root bindings (see the module doc)."""

    def __init__(self, folder: Path, trust_tcp: bool, binds: list[str] | None = None):
        self.trust_tcp = trust_tcp
        self.path = Path(folder) / BINDINGS_FILE
        self._me = os.geteuid()
        self._lock = threading.Lock()
        self._bound: dict[tuple[str, tuple[str, ...]], dict] = {}
        self._load()
        named = map(parse_bind, binds or [])
        self._operator_binds = {normalize(r): {"uid": uid, "root": r, "by": "--bind"} for r, uid in named}
        # (root, uid, source) of the replicas held (``Tiers.carried``): their origins' bindings
        self.carried: Callable[[], Iterable[tuple[str, int, str]]] = lambda: ()
        self.peer_key: bytes | None = None  # signs the tickets of ``vouch``
        self.chown = can_isolate()  # may give what it writes to a tenant (``owner_of``)

    def vouch(self, caller: Caller, root: str) -> str:
        """A ticket, signed with the peer key, that names a caller of this daemon's Unix socket to
        the ring's daemons as a reader of ``root`` (one it may read here) for ``VOUCH_S``: a rank
        reads its replicas on other nodes as itself."""
        if caller.peer is None or caller.vouched or self.peer_key is None:
            raise Forbidden("a ticket needs the daemon's Unix socket and its peer key (--peer-key-file)")
        self.check_read(caller, root)
        text = f"{caller.peer.uid} {int(time.time()) + VOUCH_S} {quote(root, safe='')}"
        return f"{text} {hmac.new(self.peer_key, f'ckptd-vouch {text}'.encode(), 'sha256').hexdigest()}"

    def vouched(self, ticket: str) -> Caller:
        """The reader of one root a peer's ticket (``vouch``) names, never an operator; else a
        TCP caller."""
        uid, until, root, mac = ([*ticket.split(" "), "", "", ""])[:4]
        want = hmac.new(self.peer_key or b"", f"ckptd-vouch {uid} {until} {root}".encode(), "sha256").hexdigest()
        ok = self.peer_key and hmac.compare_digest(mac.encode(), want.encode()) and uid.isdigit()
        if not ok or not until.isdigit() or not time.time() <= int(until) <= time.time() + VOUCH_S + 60:
            return Caller(None, self.trust_tcp)
        try:
            key = normalize(unquote(root))
        except RootError:
            return Caller(None, self.trust_tcp)
        return Caller(Peer(0, int(uid), int(uid)), False, vouched=key)

    def caller(self, scope: dict) -> Caller:
        peer = (scope.get("state") or {}).get(PEER_KEY)
        if peer is None:
            ticket = dict(scope.get("headers") or ()).get(VOUCH_HEADER.lower().encode())
            return (
                self.vouched(ticket.decode("latin-1"))
                if ticket and not self.trust_tcp
                else Caller(None, self.trust_tcp)
            )
        return Caller(peer, peer.uid in (0, self._me))

    def identified(self, caller: Caller, what: str) -> None:
        """Leases and hand-offs: the caller must be named by the kernel, or TCP trusted."""
        if (caller.peer is None or caller.vouched) and not caller.operator:
            raise Forbidden(
                f"{what} needs the daemon's Unix socket (unix://.../{SOCKET_NAME}), where the kernel names the "
                "caller: this daemon does not trust TCP callers with that (--trust-tcp)"
            )

    def owns(self, caller: Caller, uid: int | None) -> bool:
        """Whether ``caller`` may act on a lease or job of ``uid`` (None: made by a trusted TCP
        caller, which only operators may touch)."""
        return caller.operator or (caller.peer is not None and not caller.vouched and caller.peer.uid == uid)

    def _bindings(self) -> dict:
        carried = {
            normalize(r): {"uid": u, "root": r, "by": f"a replica from {s}", "carried": 1} for r, u, s in self.carried()
        }
        return {**carried, **self._bound, **self._operator_binds}

    def bound_uid(self, root: str) -> int | None:
        """The uid ``root`` is bound to here (what a replica of it carries to a peer), or None."""
        with self._lock:
            held = self._holder(normalize(root))
        return held[1]["uid"] if held is not None else None

    def carry(self, root: str, uid: int, source: str, begin: Callable[[], T]) -> T:
        """A replica of ``root`` from ``source`` carries its binding to ``uid``: Forbidden (logged)
        when this daemon binds that root, or one around or inside it, to another uid; else what
        ``begin`` (which holds the replica, so ``carried`` names it) returns. Checked and begun
        under the lock of every binding: of two replicas of one root carrying other uids, or a
        replica and a lease binding it here, the first decides and the other is refused."""
        key = normalize(root)
        with self._lock:
            b = self._bindings()
            clash = [(k, v) for k, v in b.items() if (inside(key, k) or inside(k, key)) and v["uid"] != uid]
            if not clash:
                return begin()
        k, b = clash[0]
        why = f"{source} binds job root {root} to uid {uid}, this daemon {b['root']} to {self._who((k, b))}"
        log.warning("memory tier: replica refused: %s", why)
        raise Forbidden(f"replica refused: {why}")

    def _holder(self, key) -> tuple[tuple, dict] | None:
        """The innermost binding that ``key`` lies inside (or is), if any."""
        return innermost(key, self._bindings().items())

    def check_read(self, caller: Caller, root: str) -> None:
        """Listings and verifies of ``root``: refused (403) inside another identity's root."""
        if caller.operator:
            return
        key = normalize(root)
        if caller.vouched and caller.vouched != key:
            raise Forbidden(f"{caller} holds a ticket for another root: it may not read {root}")
        with self._lock:
            held = self._holder(key)
        if held is not None and held[1]["uid"] != caller.uid:
            raise Forbidden(f"job root {root} belongs to {self._who(held)}: {caller} may not read it")

    def visible(self, caller: Caller, items: list[dict]) -> list[dict]:
        """The entries of a listing (each names its ``root``) that ``caller`` may read
        (``check_read``): over TCP without ``--trust-tcp``, those of unbound roots only."""
        out = []
        for item in items:
            with contextlib.suppress(Forbidden, RootError):
                self.check_read(caller, item["root"])
                out.append(item)
        return out

    def check_write(self, caller: Caller, root: str, bind: bool) -> None:
        """Leases and hand-offs for ``root``: refused (403) inside another identity's root, or
        when ``root`` is unbound and the caller could not write it itself (local roots) or it
        holds another identity's root. ``bind``: record the caller as the root's owner."""
        if caller.operator:
            return
        self.identified(caller, "a hand-off")
        key = normalize(root)
        with self._lock:
            held = self._holder(key)
            if held is not None:
                if held[1]["uid"] != caller.uid:
                    raise Forbidden(f"job root {root} belongs to {self._who(held)}: {caller} may not write it")
                if not (bind and held[1].get("carried")):  # its first write here binds a carried one
                    return
            for k, b in self._bindings().items():
                if inside(k, key) and b["uid"] != caller.uid:
                    raise Forbidden(f"job root {root} holds {self._who((k, b))}: {caller} may not write it")
            if key[0] == "file":
                self._check_local(caller, root, key)
            if bind:
                self._bound[key] = {"uid": caller.uid, "root": root, "time": time.time()}
                self._save()
                log.info("job root %s bound to %s", root, caller)

    def _check_local(self, caller: Caller, root: str, key) -> None:
        """The caller must be able to write ``root`` (or the nearest folder above it) itself; an
        existing root folder must not be writable by every local user, nor belong to another
        user than the caller, root or the daemon's: either could swap or read what the daemon
        commits there as the caller's (``owner_of``)."""
        path = top = Path("/" + "/".join(key[1]))
        while True:
            try:
                st = os.stat(path)  # the root itself may be a link: the operator served it
                break
            except FileNotFoundError:
                if path.parent == path:
                    raise Forbidden(f"job root {root}: no folder above it exists") from None
                path = path.parent
            except OSError as e:
                raise Forbidden(f"job root {root}: cannot check who may write {path} ({e.strerror})") from None
        if not stat.S_ISDIR(st.st_mode) or not _may_write(caller.uid, _groups(caller.peer), st):
            raise Forbidden(
                f"job root {root}: {caller} cannot write {path} itself, so the daemon does not write it on its behalf"
            )
        if path == top and st.st_mode & stat.S_IWOTH:
            mode = stat.S_IMODE(st.st_mode)
            raise Forbidden(f"job root {root} is writable by every local user (mode {mode:04o}): remove o+w")
        if path == top and st.st_uid not in (caller.uid, 0, self._me):
            raise Forbidden(
                f"job root {root} belongs to uid {st.st_uid} ({_user_name(st.st_uid)}), not to {caller}: "
                "its owner could read and replace what the daemon commits there"
            )

    def owner_of(self, root: str) -> tuple[int, int] | None:
        """(uid, gid) that what the daemon writes into ``root`` belongs to: for a local root
        inside one bound to a uid other than the daemon's, that uid and the bound folder's group
        (the uid's own group if that folder is gone); else None (the daemon's own). A daemon
        that cannot give files away (no ``CAP_CHOWN``: ``can_isolate``) gets uid -1: it keeps
        them and gives them the bound folder's group, which it shares with the tenant
        (``LocalStore``'s ``owner``)."""
        key = normalize(root)
        if key[0] != "file":
            return None
        with self._lock:
            held = self._holder(key)
        if held is None or held[1]["uid"] in (0, self._me):
            return None
        uid = held[1]["uid"]
        try:
            gid = os.stat("/" + "/".join(held[0][1])).st_gid
        except OSError:
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
        return (uid if self.chown else -1), gid

    def _who(self, held: tuple[tuple, dict]) -> str:
        b = held[1]
        how = f" ({b['by']})" if b.get("by") else ""
        return f"uid {b['uid']} ({_user_name(b['uid'])}){how}"

    def _load(self) -> None:
        try:
            raw = read_staged(self.path, cap=MAX_BINDINGS_BYTES, owner=self._me)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise StagingError(f"cannot read the job root bindings {self.path} ({e}): fix or remove it") from None
        try:
            doc = json.loads(raw)
            for b in doc["roots"]:
                if not isinstance(b["uid"], int) or not isinstance(b["root"], str):
                    raise TypeError("a binding needs an integer uid and a root")
                self._bound[normalize(b["root"])] = {"uid": b["uid"], "root": b["root"], "time": b.get("time")}
        except (ValueError, KeyError, TypeError, RecursionError, RootError) as e:
            raise StagingError(f"job root bindings {self.path} are malformed ({e}): fix or remove it") from None

    def _save(self) -> None:
        write_json_atomic(self.path, {"version": 1, "roots": list(self._bound.values())})
