"""The memory tier: the node's hot copy of the newest committed step, and its peers' replicas.

Hot copy: while a job uploads, every shard object it puts (keys under ``step_*/arrays/``) is
copied into this daemon's memory (``Tiers.recorder``); when the job's step commits with the
job's attempt, the copies of all the jobs of that (root, step, attempt) become the root's *hot
copy* and the previous one is released. A failed or superseded attempt's copies are dropped.
Hot copies are exact copies of committed objects: the manifest, the layout and the crc32c of
every chunk stored in each object stay the only truth, and a reader checks every chunk against
them (``trainer_hooks.tiered``).

Replication (``server.replication``, a mixin of ``Tiers``; the one protocol for hot copies and
memory-only parts, told apart by ``kind``): each new hot copy is pushed to the
``replicas`` daemons that follow this one in ``--peers`` (a ring; the list may name this daemon,
found by ``--advertise``), authenticated with the daemon token: ``POST /v1/tiers/replicas`` (the
objects, their sizes and whole-object crc32c), then the bytes in pieces, then ``seal``. The
receiver holds a replica only once every object arrived whole and matches its crc32c; until then
it serves nothing of it. It keeps one replica per (root, source daemon), the newest step.
With ``--discover`` the ring is read from the job root at each push instead, and a discovered
peer must pass a challenge on the push's connection before it sees the token
(``server.discovery``; ``replication.targets_for`` and ``_dial``).

Budget: every byte of a copy (hot, replica, or pending) is held through
``Staging.reserve``: a copy that does not fit is not kept (the step is then persist-only on
this node: one WARNING per step and ``ckptd_tier_degraded_total``), and a lease that needs room
reclaims copies (replicas first, then hot copies) before a save waits. A copy never makes a
save fail or wait.

Serving (``server.peers``; bulk reads on ``server.tierdata``, outside the HTTP server's event
loop): objects are looked up by (root, step, attempt, key) in this table, never by a path: no
tier route can read a file. Only complete copies are served: hot copies, replicas, and the
memory-only parts of ``server.memsteps`` (``self.memsteps``; same reads, same data path).
Every held object is a sealed memfd once complete (``server.sealed``; a ``bytearray`` where that
is not available), so its descriptor can be passed to a rank on this node, which cannot change it.

Concurrency: one lock guards the tables; it is never held while calling into ``Staging``
(``Staging`` calls ``reclaim`` under its own lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from ckptd import manifest as mf
from ckptd.server.replication import MAX_OBJECTS, PIECE_BYTES, Copy, Replication, replica_targets
from ckptd.server.sealed import Sealed, new_buffer, seal
from ckptd.server.staging import Staging
from storage_backends.base import as_buffers, data_size

__all__ = ["Copy", "MAX_BATCH_BYTES", "MAX_BATCH_RANGES", "MAX_OBJECTS", "PIECE_BYTES", "Tiers", "replica_targets"]

log = logging.getLogger("ckptd.tiers")

MAX_BATCH_BYTES = 256 << 20  # bytes one batched tier read answers at most
MAX_BATCH_RANGES = 4096  # ranges in one batched tier read at most


class Tiers(Replication):
    def __init__(
        self,
        staging: Staging,
        peers: list[str],
        me: str | None,
        replicas: int,
        token: str | None,
        timeout_s: float = 30.0,
        enabled: bool = True,
    ):
        for url in [*peers, *([me] if me else [])]:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"peer daemon must be an http(s)://host:port URL, got {url!r} (--peers, --advertise)")
        self.enabled = enabled  # False (--no-tiers): no hot copies, no replicas accepted
        self.staging = staging
        self.peers = [p.rstrip("/") for p in peers]
        self.me = me.rstrip("/") if me else None
        self.targets = replica_targets(self.peers, self.me, replicas)
        self.replicas = replicas
        self.discovery = None  # server.discovery.Discovery (--discover): the ring from the job root
        self.token = token
        self.timeout_s = timeout_s
        self.data_endpoint: dict | None = None  # the data path's {"port", "socket"} (``server.tierdata``)
        self.memsteps = None  # ``server.memsteps.MemSteps``: its parts are pushed and served here too
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int, str], Copy] = {}
        self._hot: dict[str, Copy] = {}
        self._replicas: dict[tuple[str, str], Copy] = {}
        self._incoming: dict[str, Copy] = {}
        self.counters = {
            "degraded": 0,  # steps whose hot copy or replica did not fit the budget
            "replicas_pushed": 0,
            "replica_push_failures": 0,
            "replicas_received": 0,
            "bytes_served": 0,
            "bytes_shared": 0,  # of bytes_served: passed as sealed memory, not sent over a socket
            "object_requests": 0,
            "data_requests": 0,  # of object_requests: asked on the data path (``server.tierdata``)
            "restore_bytes_local": 0,
            "restore_bytes_peer": 0,
            "restore_bytes_root": 0,
        }
        staging.reclaim = self._reclaim

    # ------------------------------------------------------------------------- accounting

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        """Metric name -> (help, value) for ``Metrics.gauge``."""

        def held(kind: str) -> Callable[[], float]:
            def fn() -> float:
                with self._lock:
                    copies = self._hot.values() if kind == "hot" else self._replicas.values()
                    return float(sum(c.bytes for c in copies))

            return fn

        def counter(name: str) -> Callable[[], float]:
            return lambda: float(self.counters[name])

        return {
            "ckptd_tier_hot_bytes": ("bytes of hot copies of committed steps held", held("hot")),
            "ckptd_tier_replica_bytes": ("bytes of complete replicas of peers' hot copies held", held("replica")),
            "ckptd_tier_replicas": ("complete replicas held", lambda: float(len(self._replicas))),
            "ckptd_tier_degraded_total": ("copies not kept for lack of budget (persist only)", counter("degraded")),
            "ckptd_tier_replicas_pushed_total": ("hot copies replicated to a peer", counter("replicas_pushed")),
            "ckptd_tier_replica_push_failures_total": ("replica pushes that failed", counter("replica_push_failures")),
            "ckptd_tier_bytes_served_total": ("tier bytes served to restoring ranks", counter("bytes_served")),
            "ckptd_tier_object_requests_total": ("ranged reads of tier objects asked", counter("object_requests")),
            "ckptd_tier_data_requests_total": (
                "tier reads asked on the data path (of ckptd_tier_object_requests_total)",
                counter("data_requests"),
            ),
            "ckptd_tier_bytes_shared_total": (
                "tier bytes lent to ranks on this node as sealed memory (of ckptd_tier_bytes_served_total)",
                counter("bytes_shared"),
            ),
            "ckptd_restore_bytes_local_total": (
                "restored bytes ranks read from their own daemon",
                counter("restore_bytes_local"),
            ),
            "ckptd_restore_bytes_peer_total": (
                "restored bytes ranks read from peer daemons",
                counter("restore_bytes_peer"),
            ),
            "ckptd_restore_bytes_root_total": (
                "restored bytes ranks read from the job root",
                counter("restore_bytes_root"),
            ),
        }

    def restored(self, local: int, peer: int, root: int) -> None:
        """A rank reports what its restore read from each tier."""
        with self._lock:
            self.counters["restore_bytes_local"] += local
            self.counters["restore_bytes_peer"] += peer
            self.counters["restore_bytes_root"] += root

    def _release(self, copies: list[Copy]) -> None:
        """Give the budget of dropped copies back (outside the lock)."""
        for c in copies:
            if c.bytes:
                self.staging.unreserve(c.bytes)

    def _drop(self, c: Copy) -> Copy:
        """Mark ``c`` dropped and forget its bytes. Holds the lock; release it after."""
        c.dropped = True
        c.objects.clear()
        return c

    def _reclaim(self, nbytes: int) -> int:
        """Called by Staging under its lock when a lease needs room: drop copies (incoming and
        replicas, then pending, then hot) until ``nbytes`` are freed; return the bytes freed
        (Staging takes them off its reservation itself)."""
        freed = 0
        with self._lock:
            order = [
                *[(self._incoming, k) for k in self._incoming],
                *[(self._replicas, k) for k in self._replicas],
                *[(self._pending, k) for k in self._pending],
                *[(self._hot, k) for k in self._hot],
            ]
            for table, k in order:
                if freed >= nbytes:
                    break
                c = table.pop(k)
                freed += c.bytes
                c.bytes = 0
                self._drop(c)
                self.counters["degraded"] += 1
                log.warning(
                    "dropping the memory-tier copy of %s step %d (from %s): a save needs the staging memory",
                    c.root,
                    c.step,
                    c.source,
                )
        return freed

    # ---------------------------------------------------------------------------- hot copy

    def recorder(self, root: str, step: int, attempt: str, rank: int) -> Callable[[str, object], None]:
        """A function the upload calls with every (key, data) it put; shard objects are copied."""
        prefix = f"{mf.step_dir(step)}/{mf.ARRAYS}/"

        def tee(key: str, data) -> None:
            if key.startswith(prefix):
                try:
                    self._add_pending(root, step, attempt, rank, key, data)
                except Exception:  # noqa: BLE001 - a copy must never fail a save
                    log.exception("memory tier: cannot copy %s", key)

        return tee

    def _add_pending(self, root: str, step: int, attempt: str, rank: int, key: str, data) -> None:
        n = data_size(data)
        gid = (root, step, attempt)
        with self._lock:
            group = self._pending.setdefault(gid, Copy(root, step, attempt, "self"))
            group.ranks.add(rank)
            if group.degraded:
                return
            old = group.objects.pop(key, None)  # a retried put
            if old is not None:
                group.bytes -= len(old)
        if old is not None:
            self.staging.unreserve(len(old))
        if not self.staging.reserve(n):
            self._degrade(gid, f"{n} more bytes do not fit the staging budget")
            return
        try:
            buf = new_buffer(n)
            pos = 0
            for v in as_buffers(data):
                buf[pos : pos + v.nbytes] = v.cast("B")
                pos += v.nbytes
            buf = seal(buf)
        except OSError as e:  # no descriptor or memory left: not kept, never a failed save
            self.staging.unreserve(n)
            self._degrade(gid, f"cannot hold {key} in memory ({e.strerror or e})")
            return
        with self._lock:
            if not group.dropped and not group.degraded:
                group.objects[key] = buf
                group.bytes += n
                return
        self.staging.unreserve(n)

    def _degrade(self, gid: tuple[str, int, str], why: str) -> None:
        with self._lock:
            group = self._pending.get(gid)
            if group is None or group.degraded:
                return
            group.degraded = True
            freed, group.bytes = group.bytes, 0
            group.objects.clear()
            self.counters["degraded"] += 1
        log.warning(
            "memory tier: no hot copy of %s step %d on this node (%s): the step is persist-only here",
            gid[0],
            gid[1],
            why,
        )
        if freed:
            self.staging.unreserve(freed)

    def committed(self, root: str, step: int, attempt: str) -> None:
        """A job of (root, step, attempt) committed: its group becomes the root's hot copy, the
        older one is released, and the new one is pushed to the peers."""
        release: list[Copy] = []
        with self._lock:
            group = self._pending.pop((root, step, attempt), None)
            if group is None:
                return  # promoted by another job of the group, or never recorded
            for gid in [g for g in self._pending if g[0] == root and g[1] <= step]:
                release.append(self._drop(self._pending.pop(gid)))
            old = self._hot.get(root)
            if group.degraded or (old is not None and old.step >= step):
                release.append(self._drop(group))
                group = None
            else:
                if old is not None:
                    release.append(self._drop(self._hot.pop(root)))
                group.complete = True
                self._hot[root] = group
        self._release(release)
        if group is not None:
            log.info(
                "memory tier: hot copy of %s step %d (%d objects, %d bytes, ranks %s)",
                root,
                step,
                len(group.objects),
                group.bytes,
                sorted(group.ranks),
            )
            self.push_later(group)

    def failed(self, root: str, step: int, attempt: str) -> None:
        """A job of (root, step, attempt) failed: its step is not this attempt's; drop the copies."""
        with self._lock:
            group = self._pending.pop((root, step, attempt), None)
            if group is not None:
                self._drop(group)
        if group is not None:
            self._release([group])

    # ----------------------------------------------------------------------------- serving

    def _copies(self, root: str, parts: list[Copy]) -> list[Copy]:
        """Under the lock: every copy of ``root`` that may serve (hot first, then replicas, then
        the memory-only ``parts``, taken from ``server.memsteps`` before the lock)."""
        out = [c for c in [self._hot.get(root)] if c is not None]
        return out + [c for (r, _), c in self._replicas.items() if r == root] + parts

    def _parts(self, root: str, step: int, attempt: str) -> list[Copy]:
        """The memory-only parts of exactly (root, step, attempt) (outside the lock)."""
        return [] if self.memsteps is None else self.memsteps.copies(root, step, attempt)

    def holding(self, root: str, step: int, attempt: str) -> list[Copy]:
        """The complete copies (hot first; memory-only parts last) of exactly (root, step, attempt)."""
        parts = self._parts(root, step, attempt)
        with self._lock:
            out = self._copies(root, parts)
            return [c for c in out if c.complete and not c.dropped and c.step == step and c.attempt == attempt]

    def keys(self, root: str, step: int, attempt: str) -> list[str]:
        found: set[str] = set()
        for c in self.holding(root, step, attempt):
            found.update(c.objects)
        return sorted(found)

    def read(self, root: str, step: int, attempt: str, key: str, start: int, length: int) -> memoryview | None:
        """``length`` bytes at ``start`` (negative: from the end) of a held object, as a read-only
        view of the copy (no copy: a held object is never written again, and a dropped copy's
        buffer lives on while a reply still sends from it); None when no complete copy of
        (root, step, attempt) holds ``key``; ValueError for a range past its end."""
        parts = self._parts(root, step, attempt)
        with self._lock:
            for c in self._copies(root, parts):
                if not c.complete or c.dropped or c.step != step or c.attempt != attempt:
                    continue
                buf = c.objects.get(key)
                if buf is None:
                    continue
                size = len(buf)
                begin = size + start if start < 0 else start
                if begin < 0 or length < 0 or begin + length > size:
                    raise ValueError(f"range {start}+{length} is outside {key!r} ({size} bytes)")
                self.counters["bytes_served"] += length
                return memoryview(buf).toreadonly()[begin : begin + length]
        return None

    def read_many(
        self, root: str, step: int, attempt: str, ranges: list[tuple[str, int, int]]
    ) -> list[memoryview] | None:
        """The views (as ``read``: no copy) of ``ranges`` ((key, start, length) each) of the
        complete copies of (root, step, attempt), in order; None when a key is not held;
        ValueError for a range outside its object or a total over ``MAX_BATCH_BYTES``."""
        total = sum(n for _, _, n in ranges)
        if total > MAX_BATCH_BYTES or any(n < 0 for _, _, n in ranges):
            raise ValueError(f"a batch of {total} bytes is over {MAX_BATCH_BYTES}")
        parts = []
        for key, start, length in ranges:
            view = self.read(root, step, attempt, key, start, length)
            if view is None:
                return None
            parts.append(view)
        return parts

    def shared(self, root: str, step: int, attempt: str, keys: list[str]) -> list[Sealed] | None:
        """The sealed buffers of ``keys`` of the complete copies of (root, step, attempt), whose
        descriptors may be passed to a reader (``server.tierdata``); None when a key is not held
        or its copy is not a sealed memfd (not Linux, or an empty object)."""
        out = []
        parts = self._parts(root, step, attempt)
        with self._lock:
            copies = [c for c in self._copies(root, parts) if c.complete and not c.dropped]
            for key in keys:
                buf = next(
                    (c.objects[key] for c in copies if c.step == step and c.attempt == attempt and key in c.objects),
                    None,
                )
                if not isinstance(buf, Sealed) or not buf.sealed:
                    return None
                out.append(buf)
            self.counters["bytes_served"] += sum(len(b) for b in out)
            self.counters["bytes_shared"] += sum(len(b) for b in out)
        return out

    def describe(self, root: str | None = None) -> dict:
        with self._lock:
            hot = [c.info() for r, c in self._hot.items() if root is None or r == root]
            reps = [c.info() for (r, _), c in self._replicas.items() if root is None or r == root]
        return {
            "peers": self.peers,
            "advertise": self.me,
            "replicate_to": self.targets,
            "hot": hot,
            "replicas": reps,
            "reserved_bytes": self.staging.reserved_bytes,
            "data": self.data_endpoint,
            **({"discovery": self.discovery.describe()} if self.discovery is not None else {}),
        }
