"""The memory tier: one table of the copies of checkpoint objects this daemon holds in memory.

A *held copy* is one rank's objects of one (root, step, attempt), made by one daemon (``source``:
``"self"``, or the URL of the peer that pushed it), keyed by (root, step, attempt, rank, source),
of one of two kinds:

- ``hot``: the shard objects (keys under ``step_*/arrays/``) of a step the job persists, copied
  into sealed memory by the upload tee (``recorder``) as they are put; complete once the step
  commits with the job's attempt (``committed``), dropped if it fails or is superseded
  (``failed``). Exact copies of committed objects: the manifest, the layout and the crc32c of
  every chunk stay the only truth, and a reader checks every chunk.
- ``memory_only``: one rank's part of a memory-only step (``persist_every``), never written to
  the job root: the one write path (``ckptd.persist.persist``) writes every object of the step's
  folder into ``holder``'s store, the same tee, and the part is complete (``held``) once its done
  record is in. No commit record exists anywhere (docs/reliability.md, "Memory-only steps").

Retention (``_retain``, per root, kind and source) keeps the complete copies of the newest
``KEEP_STEPS[kind]`` steps (memory-only: 2) and the newest memory-only step whole here, until a
newer one is (``_newest_whole``: docs/reliability.md, "Memory-only steps"); a rank's hand-off of
a memory-only (step, attempt) drops the root's memory-only parts of other attempts at that step
or newer (a replica, which may arrive late, drops none), and ``fence`` those newer than a
restored step. Budget: every byte of a copy is held through
``Staging.reserve``; a copy never makes a save wait (``_reclaim`` drops copies for a lease, in
the order docs/operations.md gives), and what does not fit is not kept or, for a memory-only
step reserved before its hand-off (``reserve``), persisted instead. Each complete own copy is
pushed to the ring (``server.replication``, a mixin of ``Tiers``); a rank's hand-off of a
memory-only step waits while an own part of an older step is still being pushed (``backpressure``).

Serving (``server.peers``, ``server.tierdata``): objects are looked up by (root, step, attempt,
key) in this table, never by a path: no tier route can read a file. Only complete copies are
served. Every held object is a sealed memfd once filled (``server.sealed``), so its descriptor
can be passed to a rank on this node, which cannot change it.

Concurrency: one lock guards the tables; it is never held while calling into ``Staging``
(``Staging`` calls ``reclaim`` under its own lock).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from ckptd import donetree
from ckptd import manifest as mf
from ckptd.codec import crc32c
from ckptd.commit import held_whole
from ckptd.errors import CheckpointError
from ckptd.pins import Pins, check_meta
from ckptd.server import capacity
from ckptd.server.handoff import ATTEMPT
from ckptd.server.parity import Parity
from ckptd.server.replication import (
    HOT,
    MAX_OBJECTS,
    MEMORY_ONLY,
    PARITY,
    PIECE_BYTES,
    Copy,
    Replication,
    charge,
    check_objects,
    part_mac,
    replica_targets,
)
from ckptd.server.sealed import Sealed, new_buffer, seal
from ckptd.server.spill import Spill, SpillError
from ckptd.server.staging import Staging
from storage_backends.base import (
    NotFoundError,
    ObjectInfo,
    Store,
    as_buffers,
    check_limit,
    data_size,
    resolve_range,
)

__all__ = ["Copy", "KEEP_STEPS", "MAX_BATCH_BYTES", "MAX_BATCH_RANGES", "MAX_OBJECTS", "PIECE_BYTES"]
__all__ += ["ORIGIN_LABELS", "RESERVE_TTL_S", "SELF", "TENANT_SHARE", "Tiers", "origin_of", "replica_targets"]

log = logging.getLogger("ckptd.tiers")

MAX_BATCH_BYTES = 256 << 20  # bytes one batched tier read answers at most
MAX_BATCH_RANGES = 4096  # ranges in one batched tier read at most
KEEP_STEPS = {HOT: 1, MEMORY_ONLY: 2, PARITY: 2}  # steps kept per (root, kind, source): ``_retain``
RESERVE_TTL_S = 600.0  # a memory-only reservation whose hand-off never came is released after this
SELF = "self"  # the source of this daemon's own copies
TENANT_SHARE = 0.5  # of the tier's objects and bytes one origin may hold at most (``--tenant-share``)
ORIGIN_LABELS = 16  # origins /metrics names one by one (the most bytes first); the rest are "other"
# Metric -> (the counter of ``Tiers.counters`` it shows, its help); ``replicas_received`` has none.
COUNTED = {
    "ckptd_tier_degraded_total": ("degraded", "copies not kept or dropped for room (budget, descriptors or mappings)"),
    "ckptd_tier_persisted_instead_total": (
        "persisted_instead",  # memory-only saves refused at their reservation
        "memory-only saves that did not fit and were persisted instead",
    ),
    "ckptd_tier_parts_held_total": ("parts_held", "ranks' parts of memory-only steps held"),
    "ckptd_tier_over_share_total": (
        "over_share",  # ``over_share``
        "copies, parts, replicas and reservations refused because their origin held its share of the tier",
    ),
    "ckptd_tier_replicas_pushed_total": ("replicas_pushed", "copies pushed to a peer (either kind)"),
    "ckptd_tier_replica_push_failures_total": ("replica_push_failures", "replica pushes that failed"),
    "ckptd_tier_backpressure_seconds_total": (
        "backpressure_seconds",  # ``backpressure``
        "seconds memory-only hand-offs waited for the previous step's replicas to be sealed",
    ),
    "ckptd_tier_spilled_total": ("spilled", "copies written to the spill folder (--spill-dir)"),
    "ckptd_tier_spill_adopted_total": ("spill_adopted", "spilled copies a restarted daemon checked and holds again"),
    "ckptd_tier_spill_refused_total": ("spill_refused", "spill files that failed their checks: removed, never served"),
    "ckptd_tier_bytes_served_total": ("bytes_served", "tier bytes served to restoring ranks"),
    "ckptd_tier_object_requests_total": ("object_requests", "ranged reads of tier objects asked"),
    "ckptd_tier_data_requests_total": (
        "data_requests",
        "tier reads asked on the data path (of ckptd_tier_object_requests_total)",
    ),
    "ckptd_tier_bytes_shared_total": (
        "bytes_shared",
        "tier bytes lent to ranks on this node as sealed memory (of ckptd_tier_bytes_served_total)",
    ),
    "ckptd_restore_bytes_local_total": ("restore_bytes_local", "restored bytes ranks read from their own daemon"),
    "ckptd_restore_bytes_peer_total": ("restore_bytes_peer", "restored bytes ranks read from peer daemons"),
    "ckptd_restore_bytes_root_total": ("restore_bytes_root", "restored bytes ranks read from the job root"),
}

Key = tuple[str, int, str, int, str]  # (root, step, attempt, rank, source)


def origin_of(uid: int | None) -> str:
    """The origin an own copy counts against (``Tiers.share``): the uid that handed it off (the
    kernel's word on the Unix socket), or "local" (a trusted TCP caller, or in-process)."""
    return "local" if uid is None else f"uid {uid}"


class Tiers(Replication, Parity):
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
        self.enabled = enabled  # False (--no-tiers): no copies held, no replicas accepted
        self.staging = staging
        self.peers = [p.rstrip("/") for p in peers]
        self.me = me.rstrip("/") if me else None
        self.targets = replica_targets(self.peers, self.me, replicas)
        self.replicas = replicas
        self.discovery = None  # server.discovery.Discovery (--discover): the ring from the job root
        self.token = token
        self.peer_key: bytes | None = None  # --peer-key-file: signs replicas (``server.peers.peer_sender``)
        self.bound_uid: Callable[[str], int | None] = lambda root: None  # ``Tenancy.bound_uid``
        self.spill: Spill | None = None  # --spill-dir: complete copies also on local disk (``server.spill``)
        self.peer_macs: dict[str, float] = {}  # signatures accepted lately -> when: a replay is refused
        self.timeout_s = timeout_s
        self.data_endpoint: dict | None = None  # the data path's {"port", "socket"} (``server.tierdata``)
        self._lock = threading.Lock()
        self._pushes = threading.Condition(self._lock)  # notified when a push ends (``backpressure``)
        self._queued: set[Copy] = set()  # copies handed to a push thread that has not named their peers
        self._held: dict[Key, Copy] = {}  # own copies (filling or complete) and complete replicas
        self._incoming: dict[str, Copy] = {}  # replicas being received, by id
        # (root, step, attempt, rank) -> (bytes, when, objects, origin)
        self._reserved: dict[tuple[str, int, str, int], tuple[int, float, int, str]] = {}
        self.share = TENANT_SHARE  # of the tier's objects and bytes one origin may hold (``over_share``)
        self._over: set[str] = set()  # origins refused for their share (logged once each)
        self.unreachable: dict[str, dict] = {}  # peer -> {time, error}: no answer to its last push or challenge
        self.last_push_failure: dict | None = None  # {time, error} of the last failed push
        self.counters = dict.fromkeys([*(name for name, _ in COUNTED.values()), "replicas_received"], 0)
        staging.reclaim = self._reclaim

    # ------------------------------------------------------------------------- accounting

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        """Metric name -> (help, value) for ``Metrics.gauge``."""

        def held(kind: str, own: bool | None = None) -> Callable[[], float]:  # own None: either source
            def fn() -> float:
                with self._lock:
                    mine = (
                        c for c in self._complete() if c.kind == kind and (own is None or (c.source == SELF) == own)
                    )
                    return float(sum(c.bytes for c in mine))

            return fn

        def replicas() -> float:
            with self._lock:
                return float(len({(c.root, c.step, c.attempt, c.source) for c in self._complete() if c.source != SELF}))

        return {
            "ckptd_tier_hot_bytes": ("bytes of hot copies of committed steps held", held(HOT, True)),
            "ckptd_tier_replica_bytes": ("bytes of complete replicas of peers' hot copies held", held(HOT, False)),
            "ckptd_tier_memory_only_bytes": (
                "bytes of memory-only steps held (own parts and replicas)",
                held(MEMORY_ONLY),
            ),
            "ckptd_tier_replicas": ("complete replicas held (one per peer's step, of either kind)", replicas),
        } | {metric: (text, lambda n=name: float(self.counters[n])) for metric, (name, text) in COUNTED.items()}

    def origin_gauges(self) -> dict[str, tuple[str, Callable[[], dict[str, float]]]]:
        """Metric name -> (help, origin -> value) for ``Metrics.labelled``: what each origin
        holds (``usage``), the ``ORIGIN_LABELS`` origins that hold the most budget by name and
        the rest summed as "other", so a flood of uids or peers cannot grow the scrape."""

        def by(field: str) -> Callable[[], dict[str, float]]:
            def fn() -> dict[str, float]:
                u = sorted(self.usage().items(), key=lambda kv: (-kv[1]["charged"], kv[0]))
                out = {o: float(v[field]) for o, v in u[:ORIGIN_LABELS]}
                if rest := u[ORIGIN_LABELS:]:
                    out["other"] = float(sum(v[field] for _, v in rest))
                return out

            return fn

        return {
            "ckptd_tier_origin_objects": ("objects of the memory tier each origin (uid or peer) holds", by("objects")),
            "ckptd_tier_origin_bytes": ("budget bytes each origin (uid or peer) holds in the tier", by("charged")),
        }

    def usage(self) -> dict[str, dict[str, int]]:
        """Origin -> {"objects", "bytes" (held), "charged" (of the staging budget, reservations
        included)}: what each origin holds of the tier, counted from the table itself."""
        with self._lock:
            return self._tally()

    def _tally(self) -> dict[str, dict[str, int]]:
        """Under the lock: ``usage``."""
        out: dict[str, dict[str, int]] = {}

        def add(origin: str, objects: int, nbytes: int, charged: int) -> None:
            u = out.setdefault(origin, dict.fromkeys(("objects", "bytes", "charged"), 0))
            u["objects"], u["bytes"], u["charged"] = u["objects"] + objects, u["bytes"] + nbytes, u["charged"] + charged

        for c in [*self._held.values(), *self._incoming.values()]:
            if not c.dropped:
                add(c.origin, len(c.objects), c.bytes, c.charged)
        for n, _, objects, origin in self._reserved.values():
            add(origin, objects, 0, n)
        return out

    def over_share(self, origin: str, objects: int, nbytes: int) -> bool:
        """Whether ``objects`` more objects and ``nbytes`` more budget bytes would take ``origin``
        past its share of the tier: ``share`` of the objects the daemon's limits let it hold
        (``server.capacity``) and of the staging budget. A tenant that fills the tier with tiny
        objects then only fills its own share: its own copies are not kept (or persisted
        instead), never another origin's. Counted each time, logged the first time per origin."""
        if self.share >= 1:
            return False
        room = capacity.room()
        cap = None if room is None else room + capacity.describe()["held"]
        with self._lock:
            u = self._tally().get(origin, {"objects": 0, "charged": 0})
            held, charged = u["objects"], u["charged"]
            why = []
            if cap is not None and held + objects > self.share * cap:
                why.append(f"{held} objects held, {objects} more, of the {int(self.share * cap)} its share allows")
            if charged + nbytes > self.share * self.staging.budget:
                why.append(f"{charged} bytes held, {nbytes} more, of {int(self.share * self.staging.budget)}")
            if not why:
                return False
            first = origin not in self._over
            if first and len(self._over) >= 4096:  # uids and peers: few, but the set stays bounded
                self._over.clear()
            self._over.add(origin)
            self.counters["over_share"] += 1
        if first:
            log.warning(
                "memory tier: %s holds its share of the tier (%s, --tenant-share %g): "
                "its further copies are not kept, its memory-only steps persisted instead",
                origin,
                "; ".join(why),
                self.share,
            )
        return True

    def restored(self, local: int, peer: int, root: int) -> None:
        """A rank reports what its restore read from each tier."""
        with self._lock:
            for kind, n in (("local", local), ("peer", peer), ("root", root)):
                self.counters[f"restore_bytes_{kind}"] += n

    # --------------------------------------------------------------- budget and retention

    def _release(self, copies: list[Copy]) -> None:
        """Drop ``copies`` (already out of the table) and give their budget back (outside the lock)."""
        for c in copies:
            if n := self._drop(c):
                self.staging.unreserve(n)

    def _drop(self, c: Copy) -> int:
        """``_drop`` (below), and its spill file removed once written (the spill thread's order)."""
        if self.spill is not None and c.spill_name and not c.dropped:
            self.spill.later(lambda: (self.spill.remove(c.spill_name), setattr(c, "spilled", False)))
        return _drop(c)

    def _take(self, keys) -> list[Copy]:
        """Under the lock: take ``keys`` out of the table (release them after)."""
        return [self._held.pop(k) for k in list(keys)]

    def _complete(self) -> Iterator[Copy]:
        return (c for c in self._held.values() if c.complete and not c.dropped)

    def _retain(self, root: str, kind: str, source: str | None = None) -> list[Copy]:
        """Under the lock: take out of the table and return (for the caller to release) the
        complete copies of ``kind`` that ``source`` (None: every source) made of ``root`` which
        the retention rule drops: all but the newest ``KEEP_STEPS[kind]`` steps per source and
        the newest memory-only step whole here (``_newest_whole``)."""
        mine = [k for k, c in self._held.items() if k[0] == root and c.kind == kind and c.complete]
        mine = [k for k in mine if source in (None, k[4])]
        keep = {(s, k[4]) for k in mine for s in sorted({j[1] for j in mine if j[4] == k[4]})[-KEEP_STEPS[kind] :]}
        whole = self._newest_whole(root) if kind == MEMORY_ONLY else None
        return self._take(k for k in mine if (k[1], k[4]) not in keep and k[1:3] != whole)

    def _newest_whole(self, root: str) -> tuple[int, str] | None:
        """Under the lock: the newest memory-only (step, attempt) of ``root`` whole here: every
        own part of it is sealed on each peer it was pushed to, and its complete parts (own and
        replicas) make it whole by themselves (``_whole``)."""
        steps: dict[tuple[int, str], list[Copy]] = {}
        for c in self._complete():
            if c.root == root and c.kind == MEMORY_ONLY:
                steps.setdefault((c.step, c.attempt), []).append(c)
        for (step, attempt), parts in sorted(steps.items(), reverse=True):
            pushed = all(set(c.pushed.values()) == {"complete"} for c in parts if c.source == SELF)
            if (pushed or not self.targets) and self._whole(root, step, attempt, parts):
                return step, attempt
        return None

    def _whole(self, root: str, step: int, attempt: str, parts: list[Copy]) -> bool:
        """Under the lock: whether ``parts`` make (step, attempt) whole by the restore's own rule
        (``commit.held_whole``: the manifest, every rank's done record, every pinned object at
        its pinned size, the commit rule)."""
        objects = {k: b for c in parts for k, b in c.objects.items()}
        try:
            held_whole(_Held(root, objects), step, attempt, {k: (len(b),) for k, b in objects.items()})
        except (CheckpointError, ValueError, TypeError) as e:
            log.debug("memory-only step %d of %s (attempt %s) is not whole here: %s", step, root, attempt, e)
            return False
        return True

    def _reclaim(self, nbytes: int) -> int:
        """Called by Staging under its lock when a lease needs room: drop copies (being received,
        then memory-only parts older than the newest step whole here, then replicas before own
        copies, hot before memory-only, oldest step first, that step's parts last) until
        ``nbytes`` are freed; return the bytes freed (Staging takes them off its reservation
        itself). A memory-only part being written is not taken: its client reserved its room."""

        def order(kc: tuple[Key, Copy]) -> tuple[int, int]:
            (root, step, attempt, _, source), c = kc
            own = source == SELF
            if c.kind == HOT:
                return (1 if not own else 2 if not c.complete else 3), step
            if (w := whole.get(root)) is not None and step < w[0]:
                return 0, step  # older than the newest whole step: can no longer be the one restored
            return (6 if (step, attempt) == w else 4 if not own else 5), step

        freed = 0
        with self._lock:
            whole = {r: self._newest_whole(r) for r in {c.root for c in self._held.values() if c.kind == MEMORY_ONLY}}
            candidates = [(rid, c) for rid, c in self._incoming.items()]
            candidates += sorted(
                ((k, c) for k, c in self._held.items() if c.kind == HOT or c.complete or c.source != SELF), key=order
            )
            for k, c in candidates:
                if freed >= nbytes:
                    break
                (self._incoming if isinstance(k, str) else self._held).pop(k)
                freed += self._drop(c)
                self.counters["degraded"] += 1
                log.warning(
                    "dropping the %s copy of %s step %d (rank %d, from %s): a save needs the staging memory",
                    c.kind,
                    c.root,
                    c.step,
                    c.rank,
                    c.source,
                )
        return freed

    def fence(self, root: str, step: int) -> int:
        """A job of ``root`` restored ``step``: drop every memory-only part newer than it (of the
        abandoned trajectory). Returns how many parts were dropped."""
        with self._lock:
            gone = self._take(
                k for k, c in self._held.items() if k[0] == root and k[1] > step and c.kind in (MEMORY_ONLY, PARITY)
            )
        self._release(gone)
        if gone:
            log.info("memory-only steps of %s newer than restored step %d dropped (%d parts)", root, step, len(gone))
        return len(gone)

    # ------------------------------------------------------------------ own copies: the tee

    def recorder(
        self, root: str, step: int, attempt: str, rank: int, kind: str = HOT, origin: str = "local"
    ) -> Callable[[str, object], None]:
        """The upload tee: a function the write path calls with every (key, data) it put, for
        ``origin`` (``origin_of`` the uid that handed it off: whose share it takes). A hot
        copy takes the step's shard objects, and a copy that does not fit is dropped for the
        whole (root, step, attempt) on this node (never a failed save); a memory-only part takes
        every object of the step's folder, and a put that cannot be held raises CheckpointError."""
        k = (root, step, attempt, rank, SELF)
        old = []
        with self._lock:
            c = self._held.get(k)
            if c is None or c.complete or c.kind != kind:  # a retried upload reuses its copy
                old = [self._held.pop(k)] if c is not None else []
                c = self._held[k] = Copy(root, step, attempt, SELF, rank=rank, kind=kind, origin=origin)
                c.degraded = kind == HOT and any(x.degraded for x in self._group(root, step, attempt))
        self._release(old)
        prefix = f"{mf.step_dir(step)}/" + (f"{mf.ARRAYS}/" if kind == HOT else "")

        def tee(key: str, data) -> None:
            if not key.startswith(prefix):
                return
            if kind == MEMORY_ONLY:
                why = self._put(c, key, data)
                if why is not None:
                    raise CheckpointError(f"memory-only step {step}: rank {rank}'s part cannot be held: {why}")
                return
            try:
                why = self._put(c, key, data)
            except Exception as e:  # noqa: BLE001 - a copy must never fail a save
                log.exception("memory tier: cannot copy %s", key)
                why = repr(e)
            if why is not None:
                self._degrade(c, why)

        return tee

    def _group(self, root: str, step: int, attempt: str) -> list[Copy]:
        """Under the lock: this node's unfinished hot copies of (root, step, attempt), every rank."""
        return [
            c
            for (r, s, a, _, src), c in self._held.items()
            if (r, s, a, src) == (root, step, attempt, SELF) and c.kind == HOT and not c.complete
        ]

    def _put(self, c: Copy, key: str, data) -> str | None:
        """Copy ``data`` into sealed memory as ``key`` of ``c``; None, or why it was not kept."""
        n = data_size(data)
        cost = charge(n, len(key))
        with self._lock:
            if c.dropped and c.kind == MEMORY_ONLY:
                return "it was dropped (a save needed its room, or a newer hand-off came)"
            if c.degraded or c.dropped:  # a hot copy not kept: its puts go nowhere
                return None
        self._forget(c, key)  # a retried put
        if self.over_share(c.origin, 1, cost):
            return f"{c.origin} holds its share of the tier (--tenant-share {self.share:g})"
        if not self.staging.reserve(cost):
            return f"{cost} more bytes do not fit the staging budget"
        try:
            buf = new_buffer(n)
            pos = 0
            for v in as_buffers(data):
                buf[pos : pos + v.nbytes] = v.cast("B")
                pos += v.nbytes
            buf = seal(buf)
        except OSError as e:  # no descriptor or memory left
            self.staging.unreserve(cost)
            return f"cannot hold {key} in memory ({e.strerror or e})"
        with self._lock:
            if not c.dropped and not c.degraded:
                c.objects[key] = buf
                c.bytes, c.charged = c.bytes + n, c.charged + cost
                return None
        self.staging.unreserve(cost)
        return None

    def _forget(self, c: Copy, key: str) -> None:
        """Take ``key`` out of ``c`` (if there) and give its bytes back."""
        with self._lock:
            old = c.objects.pop(key, None)
            if old is not None:
                cost = charge(len(old), len(key))
                c.bytes, c.charged = c.bytes - len(old), c.charged - cost
        if old is not None:
            self.staging.unreserve(cost)

    def _degrade(self, c: Copy, why: str) -> None:
        """A hot copy did not fit: none is kept of its (root, step, attempt) on this node."""
        with self._lock:
            group = self._group(c.root, c.step, c.attempt)
            first = not any(x.degraded for x in group)
            freed = 0
            for x in group:
                x.degraded = True
                freed, x.bytes, x.charged = freed + x.charged, 0, 0
                x.objects.clear()
            if first:
                self.counters["degraded"] += 1
        if first:
            log.warning(
                "memory tier: no hot copy of %s step %d on this node (%s): the step is persist-only here",
                c.root,
                c.step,
                why,
            )
        if freed:
            self.staging.unreserve(freed)

    def committed(self, root: str, step: int, attempt: str) -> None:
        """A job of (root, step, attempt) committed: this node's copies of it (every rank) become
        the root's hot copy, older ones go by the retention rule, and it is pushed to the peers."""
        with self._lock:
            group = self._group(root, step, attempt)
            if not group:
                return  # promoted by another job of the group, or never recorded
            stale = [  # other attempts' copies of this step or older: never committed
                k
                for k, c in self._held.items()
                if (k[0], k[4], c.kind) == (root, SELF, HOT) and k[1] <= step and not c.complete and c not in group
            ]
            release = self._take(stale)
            if any(c.degraded for c in group):
                release += self._take(k for k, c in self._held.items() if c in group)
                group = []
            for c in group:
                c.complete = True
            release += self._retain(root, HOT, SELF)
        self._release(release)
        group = [c for c in group if not c.dropped]
        if group:
            log.info(
                "memory tier: hot copy of %s step %d (%d objects, %d bytes, ranks %s)",
                root,
                step,
                sum(len(c.objects) for c in group),
                sum(c.bytes for c in group),
                sorted(c.rank for c in group),
            )
            for c in group:
                self.spill_later(c)
            self.push_later(group)

    def failed(self, root: str, step: int, attempt: str, rank: int | None = None) -> None:
        """A job of (root, step, attempt) failed: drop this node's unfinished copies of it (of
        ``rank`` alone when given: a memory-only part that could not be held)."""
        with self._lock:
            gone = self._take(
                k
                for k, c in self._held.items()
                if k[:3] == (root, step, attempt) and k[4] == SELF and not c.complete and rank in (None, k[3])
            )
        self._release(gone)

    # ---------------------------------------------------------------- memory-only parts

    def backpressure(self, root: str, step: int, rank: int, deadline: float) -> None:
        """Before rank's part of memory-only ``step`` is taken: wait while an own memory-only
        part of ``root`` of an older step is still being pushed to a peer (a push that failed
        does not count), until ``deadline`` (``time.time()``); CheckpointError naming the
        unsealed step and peer past it."""
        t0, waited = time.monotonic(), False
        with self._pushes:
            try:
                while late := [
                    (c.step, p)
                    for c in self._held.values()
                    if (c.root, c.kind, c.source) == (root, MEMORY_ONLY, SELF) and c.step < step
                    for p, how in ({"the ring": "pushing"} if c in self._queued else c.pushed).items()
                    if how == "pushing"
                ]:
                    why = f"step {late[0][0]}'s replica to {late[0][1]} to be sealed"
                    if not waited:
                        log.info("memory-only step %d of %s, rank %d: waits for %s", step, root, rank, why)
                        waited = True
                    if deadline <= time.time():
                        raise CheckpointError(f"step {step} waited for {why} until the save's deadline (a slow peer)")
                    self._pushes.wait(deadline - time.time())
            finally:
                self.counters["backpressure_seconds"] += time.monotonic() - t0 if waited else 0

    def holder(self, root: str, step: int, attempt: str, rank: int, origin: str = "local") -> Store:
        """The store rank's part of memory-only (root, step, attempt) is written into, for
        ``origin`` (its reservation is released: each put now holds its own bytes)."""
        self.release_reservation(root, step, attempt, rank)
        tee = self.recorder(root, step, attempt, rank, MEMORY_ONLY, origin)
        with self._lock:
            c = self._held[(root, step, attempt, rank, SELF)]
        return _Holding(self, c, tee)

    def held(self, root: str, step: int, attempt: str, rank: int) -> None:
        """Rank's part written into ``holder``'s store is complete: keep it (retention) and push
        it to the peers. CheckpointError when it was dropped meanwhile or has no done record."""
        k = (root, step, attempt, rank, SELF)
        with self._lock:
            c = self._held.get(k)
            objects = dict(c.objects) if c is not None else {}
        if c is not None and self.peer_key is not None:  # this daemon checked the hand-off's binding
            c.mac = part_mac(self.peer_key, root, self.bound_uid(root), step, attempt, rank, objects)
        with self._lock:
            if c is None or c.dropped:
                raise CheckpointError(f"memory-only step {step}: rank {rank}'s part was dropped while it was written")
            if not any(f"/{mf.DONE}/" in key for key in c.objects):
                raise CheckpointError(f"memory-only step {step}: rank {rank} wrote no done record")
            # A hand-off is the job's present: every part of this root (any source) of another
            # attempt at this step or newer is an abandoned future or the same step saved again.
            release = self._take(
                j
                for j, x in self._held.items()
                if j[0] == root and j[1] >= step and j[2] != attempt and x.kind in (MEMORY_ONLY, PARITY) and x.complete
            )
            c.lane = sum(  # its place among this node's parts of the step (``server.parity``)
                1 for j, x in self._held.items() if j[:3] == k[:3] and j[4] == SELF and x.complete and x is not c
            )
            c.complete = True
            release += self._retain(root, MEMORY_ONLY)  # wholeness is the root's: every source's
            self.counters["parts_held"] += 1
        self._release(release)
        n = len(c.objects)
        log.info("memory-only step %d of %s: rank %d held (%d objects, %d bytes)", step, root, rank, n, c.bytes)
        self.spill_later(c)
        self.push_later([c])

    def reserve(
        self, root: str, step: int, attempt: str, rank: int, nbytes: int, objects: int = 0, origin: str = "local"
    ) -> bool:
        """Hold ``nbytes`` for rank's part of a memory-only step before its hand-off; False (and
        counted, logged) when it does not fit the staging budget, or its ``objects`` do not fit
        what the daemon's descriptors and mappings let the tier hold (``server.capacity``), or
        ``origin`` (``origin_of`` the caller) would pass its share (``over_share``): the job then
        persists the step instead, rather than failing the save at hold time. Each object is
        charged its minimum too (``charge``): zero-byte objects are not free."""
        nbytes += charge(0, 0, objects)  # at least what its puts take, keys aside
        now, mine = time.monotonic(), (root, step, attempt, rank)
        with self._lock:  # this part's earlier reservation, and those whose hand-off never came, go
            old = [k for k, (_, t, _, _) in self._reserved.items() if k == mine or now - t > RESERVE_TTL_S]
            freed = sum(self._reserved.pop(k)[0] for k in old)
            pending = sum(n for _, _, n, _ in self._reserved.values())  # objects other reservations hold
        if freed:
            self.staging.unreserve(freed)
        room = capacity.room()
        why = None
        if not self.enabled:
            why = "this daemon keeps no memory tier"
        elif room is not None and objects > room - pending:
            why = f"its {objects} objects do not fit the {max(0, room - pending)} the daemon's limits leave"
        elif not self.staging.reserve(nbytes):
            why = "it does not fit the staging budget"
        elif self.over_share(origin, objects, nbytes):  # logged there, once per origin
            self.staging.unreserve(nbytes)
            self.count("persisted_instead")
            return False
        if why is not None:
            self.count("persisted_instead")
            log.warning(
                "memory-only step %d of %s (rank %d, %d bytes): %s: the step is persisted to the job root instead",
                step,
                root,
                rank,
                nbytes,
                why,
            )
            return False
        with self._lock:
            self._reserved[mine] = (nbytes, time.monotonic(), objects, origin)
        return True

    def check_whole(
        self, root: str, uid: int | None, step: int, attempt: str, rank: int, kind: str, expected: dict, objects, mac
    ) -> None:
        """ValueError unless every object of ``objects`` matches its crc32c in ``expected``
        (``check_objects``) and, a memory-only part, its MAC (``check_mac``) and its done
        record's pins (``_check_part``): what a copy held without its hand-off here passes (a
        spill file's, a part rebuilt by ``server.parity``)."""
        bad = [k for k, (_, crc) in expected.items() if crc32c(objects[k]) != crc]
        if bad:
            raise ValueError(f"{len(bad)} objects fail their crc32c, e.g. {bad[0]!r}")
        if kind == MEMORY_ONLY:  # made by a daemon of the ring for this root's binding, then whole
            self.check_mac(root, uid, step, attempt, rank, objects, kind, mac)
            _check_part(root, step, attempt, rank, objects)

    def release_reservation(self, root: str, step: int, attempt: str, rank: int) -> int:
        with self._lock:
            n = self._reserved.pop((root, step, attempt, rank), (0,))[0]
        if n:
            self.staging.unreserve(n)
        return n

    # ------------------------------------------------------------------- the spill folder

    def spill_later(self, c: Copy) -> None:
        """Write complete copy ``c`` to the spill folder on the spill thread (``server.spill``)."""
        if self.spill is None:
            return
        with self._lock:
            if c.dropped or c.spill_name:
                return
            c.spill_name = name = self.spill.new_name()
            objects = list(c.objects.items())  # the buffers live on if ``c`` is dropped meanwhile
        fields = ("root", "step", "attempt", "rank", "source", "kind", "uid", "origin", "mac")
        header = {k: getattr(c, k) for k in fields}

        def write() -> None:
            if c.dropped:
                return
            listed = [[k, len(b), c.expected[k][1] if k in c.expected else crc32c(b)] for k, b in objects]
            self.spill.write(name, header | {"objects": listed}, [b for _, b in objects])
            c.spilled = True
            self.count("spilled")

        self.spill.later(write)

    def adopt(self, check_root: Callable[[str], object]) -> int:
        """On start: hold again the copies the spill folder keeps, each only if its file passes
        every check (``server.spill``) and its root is served (``check_root`` raises otherwise)
        and it fits the budget; a file that fails is logged once and removed. Own copies are
        pushed to the ring again. Returns the copies adopted."""
        if self.spill is None:
            return 0
        mine = []
        for name in self.spill.names():
            try:
                c = self._adopt_one(name, check_root)
            except (OSError, SpillError, CheckpointError, ValueError, TypeError, KeyError, RecursionError) as e:
                self.count("spill_refused")
                log.warning("spill file %s/%s not adopted (%s): removed, never served", self.spill.path, name, e)
                self.spill.remove(name)
                continue
            with self._lock:
                key = (c.root, c.step, c.attempt, c.rank, c.source)
                old = [self._held.pop(key)] if key in self._held else []
                self._held[key] = c
                self.counters["spill_adopted"] += 1
            self._release(old)
            log.info(
                "memory tier: %s copy of %s step %d rank %d (from %s) adopted from %s",
                c.kind,
                c.root,
                c.step,
                c.rank,
                c.source,
                name,
            )
            mine += [c] if c.source == SELF else []
        with self._lock:
            release = [x for r in {c.root for c in self._held.values()} for k in KEEP_STEPS for x in self._retain(r, k)]
        self._release(release)
        self.push_later([c for c in mine if not c.dropped])
        return self.counters["spill_adopted"]

    def _adopt_one(self, name: str, check_root: Callable[[str], object]) -> Copy:
        """The complete copy spill file ``name`` holds, checked (``adopt``), its budget reserved."""
        header, bufs = self.spill.read(name, self.staging.budget, new_buffer)
        root, step, attempt, rank, source, kind = (
            header[k] for k in ("root", "step", "attempt", "rank", "source", "kind")
        )
        if not (
            isinstance(root, str) and isinstance(source, str) and isinstance(attempt, str) and ATTEMPT.match(attempt)
        ):
            raise SpillError("malformed header")
        if type(step) is not int or type(rank) is not int or step < 0 or rank < 0:
            raise SpillError("malformed header")
        check_root(root)
        uid = header.get("uid")  # a replica's carried binding (``Tenancy.carry``) comes back with it
        if uid is not None and (type(uid) is not int or not 0 <= uid < 2**32 or source == SELF):
            raise SpillError("malformed header")
        if uid is not None and self.bound_uid(root) not in (None, uid):
            raise SpillError(f"it carries {root} bound to uid {uid}; this daemon binds it to another")
        origin = header.get("origin", "") if source == SELF else source  # whose share it takes
        if source == SELF and not (isinstance(origin, str) and re.fullmatch(r"uid \d{1,10}|local", origin)):
            raise SpillError("malformed header")
        expected = check_objects(step, kind, header["objects"])
        if len(expected) != len(bufs):
            raise SpillError("an object is named twice")
        objects = dict(zip(expected, bufs, strict=True))
        self.check_whole(root, uid, step, attempt, rank, kind, expected, objects, header.get("mac"))
        objects = {k: seal(b) for k, b in objects.items()}
        c = Copy(
            root,
            step,
            attempt,
            source,
            rank,
            objects=objects,
            kind=kind,
            complete=True,
            mac=header.get("mac", ""),
            spill_name=name,
            uid=uid,
            origin=origin,
        )
        c.bytes, c.spilled = sum(s for s, _ in expected.values()), True
        c.charged = sum(charge(s, len(k)) for k, (s, _) in expected.items())
        if not self.staging.reserve(c.charged):
            raise SpillError(f"its {c.charged} bytes do not fit the staging budget")
        return c

    # ----------------------------------------------------------------------------- serving

    def holding(self, root: str, step: int, attempt: str) -> list[Copy]:
        """The complete copies of exactly (root, step, attempt): own hot copies first, then
        replicas, then memory-only parts."""
        with self._lock:
            out = [
                c for c in self._complete() if (c.root, c.step, c.attempt) == (root, step, attempt) and c.kind != PARITY
            ]
        return sorted(out, key=lambda c: (c.kind != HOT, c.source != SELF))

    def keys(self, root: str, step: int, attempt: str) -> list[str]:
        return sorted({k for c in self.holding(root, step, attempt) for k in c.objects})

    def find(self, root: str, step: int, attempt: str, key: str):
        """The buffer of ``key`` in the complete copies of (root, step, attempt), or None (not counted as served)."""
        return next((buf for c in self.holding(root, step, attempt) if (buf := c.objects.get(key)) is not None), None)

    def read(self, root: str, step: int, attempt: str, key: str, start: int, length: int) -> memoryview | None:
        """``length`` bytes at ``start`` (negative: from the end) of a held object, as a read-only
        view (no copy: a held object is never written again, and a dropped copy's buffer lives on
        while a reply sends from it); None when no complete copy of (root, step, attempt) holds
        ``key``; ValueError for a range past its end."""
        buf = self.find(root, step, attempt, key)
        if buf is None:
            return None
        size = len(buf)
        begin = size + start if start < 0 else start
        if begin < 0 or length < 0 or begin + length > size:
            raise ValueError(f"range {start}+{length} is outside {key!r} ({size} bytes)")
        self.count("bytes_served", length)
        return memoryview(buf).toreadonly()[begin : begin + length]

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
        out = [self.find(root, step, attempt, key) for key in keys]
        if not all(isinstance(buf, Sealed) and buf.sealed for buf in out):
            return None
        n = sum(len(b) for b in out)
        with self._lock:
            self.counters["bytes_served"] += n
            self.counters["bytes_shared"] += n
        return out  # type: ignore[return-value]

    def describe(self, root: str | None = None, step: int | None = None, attempt: str | None = None, keys=False):
        """What ``GET /v1/tiers`` answers: the complete copies held (of ``root``, and of exactly
        ``step`` and ``attempt`` when given): ``hot`` (one per step, with its ranks), ``replicas``
        (one per source and step), ``memory_only`` (one per rank's part), each with its objects'
        sizes with ``keys``; the ring, the budget held and the data path."""
        groups: dict[tuple, dict] = {}
        parts: list[dict] = []
        parity: list[dict] = []
        with self._lock:
            for (r, s, a, _, _), c in self._held.items():
                if not c.complete or c.dropped or (root is not None and r != root):
                    continue
                if (step is not None and s != step) or (attempt is not None and a != attempt):
                    continue
                if c.kind == PARITY:  # not objects of the step: a restore rebuilds from them (``rebuild``)
                    parity.append(c.info() | {f: c.ec[f] for f in ("stripe", "row")} | {"slots": len(c.ec["slots"])})
                    continue
                d = c.info() | ({"keys": {k: len(v) for k, v in c.objects.items()}} if keys else {})
                for p in d["replicated_to"].keys() & self.unreachable.keys():  # its copy there is gone
                    d["replicated_to"][p] = "lost: the peer does not answer"
                if c.kind == MEMORY_ONLY:
                    parts.append(d)
                    continue
                g = groups.setdefault((r, s, a, c.source), d)
                if g is d:
                    continue
                g["ranks"] = sorted(g["ranks"] + d["ranks"])
                g["bytes"] += d["bytes"]
                g["objects"] += d["objects"]
                g["spilled"] = g["spilled"] and d["spilled"]
                g.get("keys", {}).update(d.get("keys", {}))
                for peer, how in d["replicated_to"].items():
                    if g["replicated_to"].get(peer, "complete") == "complete":
                        g["replicated_to"][peer] = how
        copies = sorted(groups.values(), key=lambda g: (g["root"], g["step"], g["source"]))
        for g in copies:
            g.pop("rank")
        return {
            "peers": self.peers,
            "advertise": self.me,
            "replicate_to": self.targets,
            "hot": [g for g in copies if g["source"] == SELF],
            "replicas": [g for g in copies if g["source"] != SELF],
            "memory_only": sorted(parts, key=lambda p: (p["root"], p["step"], p["rank"], p["source"])),
            **({"ec": f"{self.ec[0]}+{self.ec[1]}", "parity": parity} if self.ec is not None else {}),
            "reserved_bytes": self.staging.reserved_bytes,
            "tenant_share": self.share,
            **({"origins": self.usage()} if root is None else {}),  # each origin's share taken
            "unreachable": dict(self.unreachable),
            "push_failures": self.counters["replica_push_failures"],
            "last_push_failure": self.last_push_failure,
            "data": self.data_endpoint,
            **({"discovery": self.discovery.describe()} if self.discovery is not None else {}),
        }


class _Held:
    """Held objects (key -> buffer) as the one reader ``held_whole`` and ``check_meta`` need."""

    def __init__(self, uri: str, objects: dict):
        self.uri, self._objects = uri, objects

    def get(self, key: str, limit: int | None = None) -> bytes:
        if key not in self._objects:
            raise NotFoundError(f"{key} is not held")
        return bytes(self._objects[key])


def _check_part(root: str, step: int, attempt: str, rank: int, objects: dict) -> None:
    """A rank's part of a memory-only step (a spill file's) against its own done record, as the
    restore's ``held_whole`` reads it: every shard object it pins held at its pinned size, every
    metadata object at its pinned sha256 (``pins.check_meta``); CheckpointError otherwise."""
    prefix = f"{donetree.folder(step, attempt, 1, rank // donetree.FANOUT)}r{rank:06d}."
    key = next((k for k in sorted(objects) if k.startswith(prefix)), None)
    if key is None:
        raise CheckpointError(f"rank {rank}'s part holds no done record of its rank")
    try:
        pins = Pins()
        pins.add(json.loads(bytes(objects[key]))["pins"], f"step {step}", key)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"its done record is unreadable ({e})") from None
    folder = mf.step_dir(step)
    for k, (size, *_) in pins.shards.items():
        if (buf := objects.get(f"{folder}/{k}")) is None or len(buf) != size:
            raise CheckpointError(f"{k} (pinned by rank {rank}) is not held at its pinned size")
    errors = check_meta(_Held(root, objects), step, pins, f"step {step} rank {rank}")
    if errors:
        raise CheckpointError(errors[0])


def _drop(c: Copy) -> int:
    """Mark ``c`` dropped and empty it; returns the budget it held (the caller gives it back)."""
    c.dropped = True
    c.objects.clear()
    n, c.bytes, c.charged = c.charged, 0, 0
    return n


class _Holding(Store):
    """The store a memory-only part is written into by the one write path: every put is the
    tee (one copy, into sealed memory); ``persist``'s own reads (its commit rules) read it back."""

    def __init__(self, tiers: Tiers, c: Copy, tee: Callable[[str, object], None]):
        self._tiers, self._c, self._tee = tiers, c, tee
        self.uri = f"memory tier [{c.root} step {c.step} rank {c.rank}]"

    def _buf(self, key: str):
        buf = self._c.objects.get(key)
        if buf is None:
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return buf

    def get(self, key: str, limit: int | None = None) -> bytes:
        buf = self._buf(key)
        check_limit(self.uri, key, len(buf), limit)
        return bytes(buf)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        buf = self._buf(key)
        begin = resolve_range(self.uri, key, start, length, len(buf))
        return bytes(buf[begin : begin + length])

    def put(self, key: str, data) -> None:
        self._tee(key, data)

    def put_if_absent(self, key: str, data) -> bool:
        if key in self._c.objects:
            return False
        self._tee(key, data)
        return True

    def delete(self, key: str) -> None:
        self._tiers._forget(self._c, key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for k in sorted(k for k in list(self._c.objects) if k.startswith(prefix)):
            yield ObjectInfo(k, len(self._c.objects.get(k, b"")), 0.0)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        rest = [info.key[len(prefix) :].partition("/") for info in self.list(prefix)]
        return [h for h, sep, _ in rest if not sep], sorted({h for h, sep, _ in rest if sep})
