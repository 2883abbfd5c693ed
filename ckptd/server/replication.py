"""Replication of the memory tier (``server.tiers``, which holds the table, lock and budget this
mixin uses): a daemon pushes each new copy to its ring successors, and receives and checks its
predecessors' replicas.

One protocol carries both kinds of copy (``kind``), one rank's objects each: ``hot`` (a committed
step's shard objects) and ``memory_only`` (a rank's part of a memory-only step: every object of
the step's folder but a commit record). Each goes to the ``replicas`` daemons after this one in
the ``--peers`` ring (which may name this daemon: ``--advertise``), or with ``--discover`` the
job root's ring, each peer challenged on the connection first (``targets_for``, ``_dial``).
With ``--ec k+m`` a memory-only part is not copied: its shares of the group's parity go to the
parity holders as a copy of a third kind, ``parity`` (``server.parity``), over this same
protocol, signed and MACed the same way, and folded into the holder's parity at seal. With
the daemon token: ``POST /v1/tiers/replicas`` (kind, objects, sizes, whole-object crc32c), the
bytes in pieces of ``PIECE_BYTES``, then ``seal``. The receiver serves nothing of a replica until
every object arrived whole and matches its crc32c, and a memory-only part its MAC for its
root's binding (``part_mac``, made by the daemon that took the part: ``check_mac``); it then
seals the buffers (``server.sealed``: read-only, shareable with a rank on its node) and keeps
it by the one retention rule (``Tiers._retain``). Replicas take their bytes from the staging
budget: one that does not fit is not kept (429); one whose pusher stopped sending is dropped
after ``INCOMING_TTL_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import quote

from ckptd import manifest as mf
from ckptd.codec import crc32c
from ckptd.daemon_conn import DaemonConnection, DaemonUnreachable
from ckptd.server.sealed import Sealed, new_buffer, seal

__all__ = ["Copy", "EC_DIR", "HOT", "INCOMING_TTL_S", "KINDS", "MAX_OBJECTS", "MEMORY_ONLY", "PARITY", "PIECE_BYTES"]
__all__ += ["Replication"]
__all__ += ["MAC_CONTEXT", "OBJECT_CHARGE", "charge", "check_objects", "part_mac", "replica_targets"]

log = logging.getLogger("ckptd.tiers")

PIECE_BYTES = 8 << 20  # replica bytes per request: under the daemon's body limit
MAX_OBJECTS = 1 << 16  # objects in one replica at most
INCOMING_TTL_S = 600.0  # a replica whose pusher stopped sending is dropped after this
HOT, MEMORY_ONLY, PARITY = "hot", "memory_only", "parity"  # the kinds of copy (module doc)
KINDS = (HOT, MEMORY_ONLY, PARITY)
EC_DIR = ".ec"  # a parity push's objects: ``step_*/.ec/<lane>/...`` (``server.parity``), never a step's
OBJECT_CHARGE = 512  # budget bytes a held object takes at least, besides its key (measured: ~170)
MAC_CONTEXT = b"ckptd memstep v1"  # the label of a root's memory-only part key (``part_mac``)


def charge(size: int, key_bytes: int = 0, objects: int = 1) -> int:
    """The staging budget ``objects`` held objects of ``size`` bytes in all (keys of ``key_bytes``)
    take: their bytes, but at least ``OBJECT_CHARGE`` each and their keys (docs/operations.md):
    a zero-byte object still costs the daemon its key and table entries."""
    return max(size, objects * OBJECT_CHARGE + key_bytes)


@dataclass(eq=False)
class Copy:
    """One rank's objects of one (root, step, attempt) held in memory (``Tiers``' table)."""

    root: str
    step: int
    attempt: str
    source: str  # "self" for this daemon's own copy, the pushing daemon's URL for a replica
    rank: int = 0
    origin: str = ""  # whose share of the tier it takes (``Tiers.share``): "uid N", or the pushing peer
    objects: dict[str, Sealed | bytearray] = field(default_factory=dict)  # sealed once complete (``sealed``)
    expected: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica: key -> (size, crc32c)
    filled: dict[str, int] = field(default_factory=dict)  # replica: bytes received per key
    bytes: int = 0  # the objects' bytes (what users see)
    charged: int = 0  # what they take from the staging budget (``charge``)
    complete: bool = False
    degraded: bool = False  # a hot copy that did not fit: none kept of this step on this node
    dropped: bool = False
    created: float = field(default_factory=time.monotonic)
    pushed: dict[str, str] = field(default_factory=dict)  # peer -> "pushing", "complete" or why not
    kind: str = HOT  # HOT, MEMORY_ONLY or PARITY
    uid: int | None = None  # replica: the uid its origin binds its root to (``Tenancy.carried``)
    mac: str = ""  # a memory-only part: its ``part_mac`` (made where it was handed off, checked where held)
    spill_name: str = ""  # its file in the spill folder (``server.spill``), once queued to be written
    spilled: bool = False  # that file is written and fsynced
    lane: int = 0  # an own memory-only part: its place among this node's parts of its step (``server.parity``)
    ec: dict = field(default_factory=dict)  # a parity block: its stripe, row and each slot's header

    def info(self) -> dict:
        info = {k: getattr(self, k) for k in ("root", "step", "attempt", "source", "kind", "rank")}
        info |= {"ranks": [self.rank], "bytes": self.bytes, "objects": len(self.objects), "complete": self.complete}
        info |= {"spilled": self.spilled}
        return info | {"replicated_to": dict(self.pushed)}


def check_objects(step: int, kind: str, objects: list) -> dict[str, tuple[int, int]]:
    """Key -> (size, crc32c) of the ``objects`` ((key, size, crc32c) each) of one rank's copy of
    ``kind`` of ``step`` (a pushed replica's, or a spill file's: ``server.spill``); ValueError
    unless each is an object of the step's folder of that kind (module doc), not a commit record."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if len(objects) > MAX_OBJECTS:
        raise ValueError(f"a copy of {len(objects)} objects is over {MAX_OBJECTS}")
    folder = mf.step_dir(step)
    prefix = {MEMORY_ONLY: f"{folder}/", PARITY: f"{folder}/{EC_DIR}/"}.get(kind, f"{folder}/{mf.ARRAYS}/")
    expected: dict[str, tuple[int, int]] = {}
    for key, size, crc in objects:
        size, crc = int(size), int(crc)
        parts = key.split("/") if isinstance(key, str) else [""]
        if "" in parts or not key.startswith(prefix) or ".." in parts or size < 0 or not 0 <= crc < 2**32:
            raise ValueError(f"replica object {key!r} is not an object of step {step} ({kind})")
        if parts[1] == mf.COMMIT:
            raise ValueError("a replica holds no commit record")
        expected[key] = (size, crc)
    return expected


def part_mac(peer_key: bytes, root: str, uid: int | None, step: int, attempt: str, rank: int, objects: dict) -> str:
    """The MAC (HMAC-SHA256, hex) of rank's part of memory-only (root, step, attempt), keyed by the
    root's part key ``HMAC(peer_key, MAC_CONTEXT | root | uid)`` (``uid``: the uid the root is
    bound to, None when unbound): only a daemon of the ring can compute it, and for one binding
    (docs/security.md, "Memory-only steps: each part is MACed"). It covers (step, attempt,
    rank), every object's key and size (which delimit what follows), and the bytes of every
    object outside ``arrays/`` (the manifest, the done records and other metadata, as they are:
    not their inner structure); the shard bytes are bound to those by the pins the done record
    holds, which every reader checks."""
    key = hmac.new(peer_key, b"\n".join([MAC_CONTEXT, root.encode(), str(uid).encode()]), hashlib.sha256).digest()
    shards = f"{mf.step_dir(step)}/{mf.ARRAYS}/"
    h = hmac.new(
        key, json.dumps([step, attempt, rank, sorted((k, len(v)) for k, v in objects.items())]).encode(), "sha256"
    )
    for k in sorted(k for k in objects if not k.startswith(shards)):
        h.update(memoryview(objects[k]).cast("B"))
    return h.hexdigest()


def replica_targets(peers: list[str], me: str | None, k: int) -> list[str]:
    """The ``k`` daemons after ``me`` in the ring ``peers`` (the first ``k`` when ``me`` is not
    in it), never ``me`` itself."""
    ring = [p.rstrip("/") for p in peers]
    mine = (me or "").rstrip("/")
    if mine in ring:
        i = ring.index(mine)
        ring = ring[i + 1 :] + ring[:i]
    return [p for p in ring if p != mine][: max(0, k)]


class Replication:
    """The replica half of ``Tiers`` (a mixin: it uses the tables, lock and budget of ``Tiers``)."""

    def targets_for(self, root: str) -> list[str]:
        """The daemons a hot copy of ``root`` is pushed to: ``--peers``' ring, or the discovered one."""
        if self.discovery is None:
            return self.targets
        return self.discovery.targets(root, self.replicas)

    def _dial(self, peer: str) -> DaemonConnection:
        """A connection to ``peer`` that sends the token (to a discovered peer once it passed the
        challenge) and signs each request with the peer key."""
        if self.discovery is None:
            conn = DaemonConnection(peer, self.token, self.timeout_s)
        else:
            conn = self.discovery.dial(peer, self.timeout_s)
            conn.token = self.token
        conn.peer = (self.peer_key, self.me or "unnamed")
        return conn

    def push_later(self, copies: list[Copy]) -> None:
        """Push ``copies`` to the ring's daemons on a thread of their own (none when there is no ring)."""
        if self.peer_key and (self.targets or self.discovery is not None or self.ec is not None):
            with self._lock:
                self._queued.update(copies)
            threading.Thread(target=self._push_all, args=(copies,), name="ckptd-tier-push", daemon=True).start()

    def _push_all(self, copies: list[Copy]) -> None:
        for c in copies:
            shares = None
            if self.ec is not None and c.kind == MEMORY_ONLY:
                try:
                    shares = self.ec_shares(c)
                except Exception as e:  # noqa: BLE001 - logged; the part is then held here alone
                    log.exception("memory tier: no parity of %s step %d rank %d: %s", c.root, c.step, c.rank, e)
                    shares = {}
            peers = list(shares) if shares is not None else self.targets_for(c.root)
            with self._pushes:
                c.pushed.update(dict.fromkeys(peers, "pushing"))  # a step is whole once all are complete
                self._queued.discard(c)
                self._pushes.notify_all()
            for peer in peers:
                what = (c.kind, c.root, c.step, c.rank, peer)
                try:
                    self._push(peer, c if shares is None else shares[peer])
                except Exception as e:  # noqa: BLE001 - a peer that is gone must not stop the daemon
                    c.pushed[peer] = f"failed: {e}"
                    self.count("replica_push_failures")
                    now, why = time.time(), f"{c.kind} replica of {c.root} step {c.step} rank {c.rank} to {peer}: {e}"
                    self.last_push_failure = {"time": now, "error": why}
                    if isinstance(e, DaemonUnreachable):  # not a refusal: the peer did not answer
                        self.unreachable[peer] = {"time": now, "error": str(e)}
                    log.warning("memory tier: %s replica of %s step %d (rank %d) to %s failed: %s", *what, e)
                else:
                    c.pushed[peer] = "complete"
                    self.unreachable.pop(peer, None)
                    self.count("replicas_pushed")
                    log.info("memory tier: %s %s step %d rank %d pushed to %s", *what)
            if c.kind == MEMORY_ONLY:  # sealed on its peers, its step may be whole here now
                with self._pushes:  # and a newer step's hand-off may go on (``Tiers.backpressure``)
                    release = self._retain(c.root, MEMORY_ONLY)
                    self._pushes.notify_all()
                self._release(release)

    def _push(self, peer: str, group: Copy) -> None:
        with self._lock:
            objects = dict(group.objects)  # the bytearrays themselves; a dropped copy clears the dict only
        body = {k: getattr(group, k) for k in ("root", "step", "attempt", "kind")}
        body["ranks"], body["uid"] = [group.rank], self.bound_uid(group.root)  # the binding travels with it
        body["objects"] = [{"key": k, "size": len(v), "crc32c": crc32c(v)} for k, v in objects.items()]
        body["mac"] = group.mac  # a memory-only part's: the receiver checks it (``check_mac``)
        conn = self._dial(peer)
        try:
            rid = json.loads(_request(conn, "POST", "/v1/tiers/replicas", body))["replica"]
            for key, buf in objects.items():
                mv = memoryview(buf)
                for off in range(0, len(buf), PIECE_BYTES):
                    if group.dropped:
                        raise RuntimeError("the copy was dropped during the push (a newer step, or its room)")
                    q = f"/v1/tiers/replicas/{rid}?key={quote(key, safe='')}&offset={off}"
                    _request(conn, "PUT", q, mv[off : off + PIECE_BYTES])
            _request(conn, "POST", f"/v1/tiers/replicas/{rid}/seal", {})
        finally:
            conn.close()

    def fence_peers(self, root: str, step: int, silent: frozenset[str] = frozenset(), wait_s: float = 1.0) -> None:
        """Forward a fence of ``root`` at restored ``step`` to every peer of the ring, signed
        (``POST /v1/tiers/restored``), each on a thread of its own; wait ``wait_s`` at most (a
        slow peer still gets it; one that is gone holds nothing any more), and not at all for
        the peers of ``silent``: the restore found them silent, and waiting for them again would
        add ``wait_s`` to its end (each still gets its fence, on its thread)."""
        peers = [p for p in self.peers if p != self.me] if self.peer_key else []
        body = {"job_root": root, "restored_step": step}

        def send(peer: str) -> None:
            try:
                conn = self._dial(peer)
                try:
                    _request(conn, "POST", "/v1/tiers/restored", body)
                finally:
                    conn.close()
            except Exception as e:  # noqa: BLE001 - a peer that is gone must not fail the restore
                log.warning("memory tier: could not tell %s that %s restored step %d: %s", peer, root, step, e)

        threads = [threading.Thread(target=send, args=(p,), name="ckptd-tier-fence", daemon=True) for p in peers]
        deadline = time.monotonic() + wait_s
        for t in threads:
            t.start()
        for p, t in zip(peers, threads, strict=True):
            if p.rstrip("/") not in silent:
                t.join(max(0.0, deadline - time.monotonic()))

    def carried(self) -> list[tuple[str, int, str]]:
        """(root, uid, source) of the replicas held or being received that carry a binding."""
        with self._lock:
            copies = [*self._held.values(), *self._incoming.values()]
        return [(c.root, c.uid, c.source) for c in copies if c.uid is not None and not c.dropped]

    def begin_replica(
        self,
        root: str,
        step: int,
        attempt: str,
        source: str,
        ranks: list[int],
        objects: list,
        kind: str = HOT,
        uid: int | None = None,
        mac: str = "",
    ) -> str:
        """A peer starts pushing a replica of ``kind``: its id, or "" when it is not kept (no room
        in the budget, or tiers off: HTTP 429). ValueError unless it is exactly one rank's objects
        of its step of that kind (module doc), without a commit record."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not self.enabled:
            return ""
        if len(ranks) != 1:
            raise ValueError("a replica is one rank's copy")
        expected = check_objects(step, kind, [(o["key"], o["size"], o["crc32c"]) for o in objects])
        total = sum(charge(s, len(k)) for k, (s, _) in expected.items())
        self._expire_incoming()
        what = (kind, root, step)
        if self.over_share(source, len(expected), total):
            return ""
        if not self.staging.reserve(total):
            self.count("degraded")
            log.warning(
                "memory tier: no room for the %s replica of %s step %d from %s (%d bytes): not kept",
                *what,
                source,
                total,
            )
            return ""
        rid = uuid.uuid4().hex
        c = Copy(root, step, attempt, source, ranks[0], source, expected=expected, kind=kind, charged=total, uid=uid)
        c.mac = mac
        c.bytes = sum(s for s, _ in expected.values())
        try:
            c.objects = {k: new_buffer(s) for k, (s, _) in expected.items()}
        except OSError as e:
            self.staging.unreserve(total)
            self.count("degraded")
            log.warning("memory tier: cannot hold the %s replica of %s step %d in memory: %s", *what, e)
            return ""
        c.filled = dict.fromkeys(expected, 0)
        with self._lock:
            self._incoming[rid] = c
        return rid

    def put_piece(self, rid: str, key: str, offset: int, data: bytes) -> None:
        with self._lock:
            c = self._incoming.get(rid)
            if c is None:
                raise KeyError(f"no replica {rid!r} being received")
            if key not in c.expected:
                raise ValueError(f"replica {rid}: {key!r} is not one of its objects")
            if offset != c.filled[key] or offset + len(data) > c.expected[key][0]:
                raise ValueError(f"replica {rid}: piece at {offset} of {key!r} out of order or past its end")
            c.objects[key][offset : offset + len(data)] = data
            c.filled[key] += len(data)

    def seal(self, rid: str) -> None:
        """Every object arrived whole and matches its crc32c: the replica counts from now on."""
        with self._lock:
            c = self._incoming.pop(rid, None)
        if c is None:
            raise KeyError(f"no replica {rid!r} being received")
        bad = [k for k, (size, crc) in c.expected.items() if c.filled[k] != size or crc32c(c.objects[k]) != crc]
        if bad:
            self._release([c])
            raise ValueError(f"replica {rid}: {len(bad)} objects incomplete or failing their crc32c, e.g. {bad[0]!r}")
        try:
            self.check_mac(c.root, c.uid, c.step, c.attempt, c.rank, c.objects, c.kind, c.mac)
            if c.kind == PARITY:  # folded into this daemon's parity blocks, then let go
                self.fold_in(c)
        except ValueError as e:
            self._release([c])
            log.warning("memory tier: replica from %s refused, never served: %s", c.source, e)
            raise ValueError(f"replica {rid} refused: {e}") from None
        if c.kind == PARITY:
            self._release([c])
            self.count("replicas_received")
            return
        try:
            c.objects = {k: seal(v) for k, v in c.objects.items()}  # read-only from now on
        except OSError as e:  # no descriptor or mapping left: refused whole, its budget given back
            self.count("degraded")
            self._release([c])
            log.warning("memory tier: cannot hold the replica of %s step %d in memory: %s", c.root, c.step, e)
            raise ValueError(f"replica {rid}: not kept, this daemon cannot hold it ({e.strerror or e})") from e
        c.complete = True
        key = (c.root, c.step, c.attempt, c.rank, c.source)
        with self._lock:
            release = [old] if (old := self._held.pop(key, None)) is not None else []
            self._held[key] = c
            release += self._retain(c.root, c.kind, None if c.kind == MEMORY_ONLY else c.source)
            kept = c not in release
            self.counters["replicas_received"] += kept
        self._release(release)
        if kept:
            self.spill_later(c)
            log.info(
                "memory tier: %s replica of %s step %d rank %d from %s complete (%d bytes)",
                c.kind,
                c.root,
                c.step,
                c.rank,
                c.source,
                c.bytes,
            )

    def check_mac(
        self, root: str, uid: int | None, step: int, attempt: str, rank: int, objects: dict, kind: str, mac
    ) -> None:
        """ValueError unless ``mac`` is the ``part_mac`` of a memory-only part (a pushed replica's,
        a spill file's, a rebuilt one's) or of a parity push's shares (``server.parity``) for
        ``root`` bound to ``uid`` (None: the uid this daemon binds it to): made by a daemon of the
        ring for that binding. Hot copies carry none."""
        if kind == HOT:
            return
        if self.peer_key is None:
            raise ValueError("this daemon has no peer key (--peer-key-file) to check a memory-only part's MAC")
        uid = self.bound_uid(root) if uid is None else uid
        want = part_mac(self.peer_key, root, uid, step, attempt, rank, objects)
        if not (isinstance(mac, str) and hmac.compare_digest(mac.encode(), want.encode())):
            raise ValueError(
                f"rank {rank}'s {'parity shares' if kind == PARITY else 'part'} of memory-only step {step} of {root} "
                "fails its MAC: "
                f"not made by a daemon of this ring for that root bound to uid {uid}"
            )

    def _expire_incoming(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [self._incoming.pop(r) for r, c in list(self._incoming.items()) if now - c.created > INCOMING_TTL_S]
        self._release(gone)


def _request(conn: DaemonConnection, method: str, path: str, body) -> bytes:
    status, _, raw = conn.fetch(method, path, body)
    if status != 200:
        raise RuntimeError(f"{method} {path.split('?')[0]}: HTTP {status} {raw[:200].decode(errors='replace')}")
    return raw
