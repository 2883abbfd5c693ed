"""Memory-only steps: whole checkpoints held in the daemons' memory, never written to the job root.

A ``Checkpointer(..., daemon=URL, persist_every=K)`` hands every save to its node's daemon; the
steps not divisible by K come marked ``memory_only``. For such a job the daemon runs the one
write path (``ckptd.persist.persist``) into an in-memory store of its own instead of the job
root, so it holds exactly the objects a persisted step would have put: the rank's shard objects,
the metadata (``zarr.json`` nodes, rank 0's ``manifest.json``) and the rank's done record with
its pins. Nothing is claimed, uploaded or written under the job root, and no commit record
exists anywhere: a memory-only step is never shown as committed in the job root.

Unit: one *part* = one rank's objects of one (root, step, attempt), a ``tiers.Copy`` of kind
``memory_only`` with ``ranks == {rank}``, its objects in sealed memory (``server.sealed``) like a
hot copy's. A part is complete once its done record is in (it is written last, after every
object the record pins), and is then pushed, like a hot copy and by the same code, to the
``replicas`` daemons after this one in the ring (``server.replication``: ``POST
/v1/tiers/replicas`` with kind ``memory_only``, pieces, ``seal``: the receiver keeps a replica
only once every object arrived whole and matches its crc32c, then hands it to ``keep``). The
tier serves the parts as it serves hot copies (``Tiers.read``/``shared``, ``server.peers``,
``server.tierdata``: ranged reads, the data path, sealed descriptors passed to a rank on this
node). A step is restorable when the union of the surviving daemons holds its manifest, every
rank's done record and every object those records pin (``trainer_hooks.memsteps`` decides,
checking every chunk against the pins as it reads).

Retention, per root, separately for this node's own parts and for each source's replicas: the
parts of the newest ``KEEP_STEPS`` (2) steps are kept, so a node dying during step N's save
leaves N-1 whole on its peers; a rank's hand-off of (step, attempt) drops every part of the
root, of any source, of another attempt at the same or a newer step (an abandoned future: the
job restored and saves again; a replica, which may arrive late, drops none), and
``fence(root, step)`` (a restore of ``step``, ``POST /v1/tiers/restored``) drops every part
newer than ``step``.

Budget: every byte is held through ``Staging.reserve``. A client reserves the step's bytes
before its hand-off (``reserve``, on the training thread; the ranks agree on the outcome): if
any rank's daemon has no room the whole step is persisted instead (``ckptd_memsteps_persisted
_instead_total`` and a WARNING here and on rank 0), so a memory-only step is never silently
lost. A lease that needs room reclaims memory-only parts (replicas first, oldest first) after
the tier's own copies (``Tiers._reclaim``); each such drop is logged and counted.

Concurrency: one lock guards the tables; it is never held while calling into ``Staging``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckptd import manifest as mf
from ckptd import persist
from ckptd.errors import CheckpointError
from ckptd.server import capacity
from ckptd.server.handoff import Job, load
from ckptd.server.replication import MEMORY_ONLY, Copy
from ckptd.server.sealed import new_buffer, seal
from ckptd.server.staging import Staging
from storage_backends.memory import MemoryStore

__all__ = ["KEEP_STEPS", "MemSteps", "RESERVE_TTL_S"]

log = logging.getLogger("ckptd.memsteps")

KEEP_STEPS = 2  # memory-only steps kept per root (own parts; and per replica source)
RESERVE_TTL_S = 600.0  # a reservation whose hand-off never came is released after this


class MemSteps:
    """The memory-only parts this daemon holds (its ranks' and its peers' replicas)."""

    def __init__(self, staging: Staging, tiers, enabled: bool = True):
        self.staging = staging
        self.tiers = tiers  # ``server.tiers.Tiers``: peers, ring targets, token, timeout
        self.enabled = enabled
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int, str, int, str], Copy] = {}  # (root, step, attempt, rank, source)
        self._reserved: dict[tuple[str, int, str, int], tuple[int, float, int]] = {}  # -> (bytes, when, objects)
        self._io = ThreadPoolExecutor(4, thread_name_prefix="ckptd-memstep-io")
        self.counters = {"held": 0, "persisted_instead": 0, "dropped_for_room": 0, "replicas_pushed": 0}
        self.counters |= {"replica_push_failures": 0, "replicas_received": 0, "fenced": 0}
        inner = staging.reclaim

        def reclaim(nbytes: int) -> int:  # the tier's copies first, then memory-only parts
            freed = inner(nbytes) if inner is not None else 0
            return freed + (self._reclaim(nbytes - freed) if freed < nbytes else 0)

        staging.reclaim = reclaim
        tiers.memsteps = self  # pushed, received and served by the tier (``server.replication``)

    # ------------------------------------------------------------------------- accounting

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        def held() -> float:
            with self._lock:
                return float(sum(c.bytes for c in self._parts.values()))

        def counter(name: str) -> Callable[[], float]:
            return lambda: float(self.counters[name])

        return {
            "ckptd_memsteps_bytes": ("bytes of memory-only steps held (own parts and replicas)", held),
            "ckptd_memsteps_parts_held_total": ("ranks' parts of memory-only steps taken", counter("held")),
            "ckptd_memsteps_persisted_instead_total": (
                "memory-only saves that did not fit the staging budget and were persisted instead",
                counter("persisted_instead"),
            ),
            "ckptd_memsteps_dropped_for_room_total": (
                "memory-only parts dropped because a save needed the staging memory",
                counter("dropped_for_room"),
            ),
            "ckptd_memsteps_replicas_pushed_total": (
                "memory-only parts replicated to a peer",
                counter("replicas_pushed"),
            ),
            "ckptd_memsteps_replica_push_failures_total": (
                "memory-only part pushes that failed",
                counter("replica_push_failures"),
            ),
        }

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _reclaim(self, nbytes: int) -> int:
        """Under Staging's lock: drop parts (replicas first, oldest steps first)."""
        freed = 0
        with self._lock:
            order = sorted(self._parts, key=lambda k: (k[4] == "self", k[1]))
            for k in order:
                if freed >= nbytes:
                    break
                c = self._parts.pop(k)
                freed += c.bytes
                c.bytes = 0
                c.dropped = True
                c.objects.clear()
                self.counters["dropped_for_room"] += 1
                log.warning(
                    "dropping memory-only step %d of %s (rank %d, from %s): a save needs the staging memory",
                    k[1],
                    k[0],
                    k[3],
                    k[4],
                )
        return freed

    # ----------------------------------------------------------------------- reservations

    def reserve(self, root: str, step: int, attempt: str, rank: int, nbytes: int, objects: int = 0) -> bool:
        """Hold ``nbytes`` for rank's part of a memory-only step before its hand-off; False (and
        counted, logged) when it does not fit the staging budget, or its ``objects`` do not fit
        what the daemon's descriptors and mappings let the tier hold (``server.capacity``): the
        job then persists the step instead, rather than failing the save at hold time."""
        self._expire_reservations()
        key = (root, step, attempt, rank)
        with self._lock:
            old = self._reserved.pop(key, None)
            pending = sum(n for _, _, n in self._reserved.values())  # objects other reservations hold
        if old is not None:
            self.staging.unreserve(old[0])
        room = capacity.room()
        why = None
        if not self.enabled:
            why = "this daemon keeps no memory tier"
        elif room is not None and objects > room - pending:
            why = f"its {objects} objects do not fit the {max(0, room - pending)} the daemon's limits leave"
        elif not self.staging.reserve(nbytes):
            why = "it does not fit the staging budget"
        if why is not None:
            self._count("persisted_instead")
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
            self._reserved[key] = (nbytes, time.monotonic(), objects)
        return True

    def release_reservation(self, root: str, step: int, attempt: str, rank: int) -> int:
        with self._lock:
            got = self._reserved.pop((root, step, attempt, rank), None)
        if got is not None:
            self.staging.unreserve(got[0])
            return got[0]
        return 0

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, (_, t, _) in self._reserved.items() if now - t > RESERVE_TTL_S]
            gone = [self._reserved.pop(k)[0] for k in old]
        for n in gone:
            self.staging.unreserve(n)

    # ------------------------------------------------------------------------------ hold

    def hold(self, job: Job, lease_dir) -> None:
        """Write ``job`` (a rank's part of a memory-only step) into memory with the one write
        path, keep it, and push it to the peers. CheckpointError when it cannot be held."""
        if not self.enabled:
            raise CheckpointError("this daemon keeps no memory tier (--no-tiers): memory-only steps are refused")
        store = MemoryStore()
        part = load(job, lease_dir)
        try:
            try:
                persist.persist(
                    store, part, self._io, writer=job.writer or job.attempt, wait=False, claim="caller", heartbeat=False
                )
            except CheckpointError:
                # A job of one rank completes its done tree at once and its commit rules find no
                # claim (none is made in memory): its done record is written all the same.
                if job.world_size != 1:
                    raise
        finally:
            del part  # unmap the staging files
        prefix = mf.step_dir(job.step) + "/"
        objects: dict = {}  # the store's own immutable bytes: served as read-only views, no copy
        for info in store.list(prefix):
            objects[info.key] = store.get(info.key)
        if not any(f"/{mf.DONE}/" in k for k in objects):
            raise CheckpointError(f"memory-only step {job.step}: rank {job.rank} wrote no done record")
        total = sum(len(v) for v in objects.values())
        self.release_reservation(job.root, job.step, job.attempt, job.rank)
        if not self.staging.reserve(total):
            raise CheckpointError(
                f"memory-only step {job.step}: {total} bytes of rank {job.rank} no longer fit the staging budget"
            )
        try:  # sealed memory, as a hot copy's: served on the data path, lent to a rank on this node
            objects = {k: _sealed(v) for k, v in objects.items()}
        except OSError as e:
            self.staging.unreserve(total)
            raise CheckpointError(f"memory-only step {job.step}: cannot hold rank {job.rank}'s part: {e}") from None
        c = Copy(job.root, job.step, job.attempt, "self", objects=objects, ranks={job.rank}, bytes=total, complete=True)
        c.kind = MEMORY_ONLY
        self.keep(c)
        self._count("held")
        log.info(
            "memory-only step %d of %s: rank %d held (%d objects, %d bytes)",
            job.step,
            job.root,
            job.rank,
            len(objects),
            total,
        )
        self.tiers.push_later(c, self._count)  # the tier's one replica protocol (``server.replication``)

    def keep(self, c: Copy) -> None:
        """Add complete part ``c`` (own, or a replica sealed by ``Tiers.seal``); apply the
        retention rules of the module docstring."""
        (rank,) = c.ranks
        release: list[Copy] = []
        with self._lock:
            if c.source == "self":
                # A hand-off is the job's present: every part of this root (any source) of
                # another attempt at this step or newer is an abandoned future or the same step
                # saved again. (A replica may arrive late, after newer hand-offs: it drops none.)
                ours = [k for k in self._parts if k[0] == c.root]
                for k in [k for k in ours if k[1] >= c.step and k[2] != c.attempt]:
                    release.append(self._parts.pop(k))
            self._parts[(c.root, c.step, c.attempt, rank, c.source)] = c
            steps = sorted({k[1] for k in self._parts if k[0] == c.root and k[4] == c.source}, reverse=True)
            for k in [k for k in self._parts if k[0] == c.root and k[4] == c.source and k[1] not in steps[:KEEP_STEPS]]:
                release.append(self._parts.pop(k))
        self._release(release)

    def _release(self, copies: list[Copy]) -> None:
        for c in copies:
            c.dropped = True
            c.objects.clear()
            n, c.bytes = c.bytes, 0
            if n:
                self.staging.unreserve(n)

    def fence(self, root: str, step: int) -> int:
        """A job of ``root`` restored ``step``: drop every part newer than it (of the abandoned
        trajectory). Returns how many parts were dropped."""
        with self._lock:
            gone = [self._parts.pop(k) for k in [k for k in self._parts if k[0] == root and k[1] > step]]
            self.counters["fenced"] += len(gone)
        self._release(gone)
        if gone:
            log.info("memory-only steps of %s newer than restored step %d dropped (%d parts)", root, step, len(gone))
        return len(gone)

    # ----------------------------------------------------------------------------- serving

    def copies(self, root: str, step: int, attempt: str) -> list[Copy]:
        """The complete parts of exactly (root, step, attempt), own and replicas: the tier serves
        them (``Tiers.read``, ``shared``; the data path) as it serves its hot copies."""
        with self._lock:
            return [
                c
                for (r, s, a, _, _), c in self._parts.items()
                if r == root and s == step and a == attempt and c.complete and not c.dropped
            ]

    def describe(self, root: str | None = None) -> list[dict]:
        """The complete parts held (of ``root``), each with its keys and their sizes."""
        with self._lock:
            parts = [(k, c) for k, c in self._parts.items() if root is None or k[0] == root]
            return [
                c.info() | {"rank": k[3], "keys": {key: len(v) for key, v in c.objects.items()}}
                for k, c in parts
                if c.complete and not c.dropped
            ]

    def describe_brief(self, root: str | None = None) -> list[dict]:
        """``describe`` without the key lists (``GET /v1/tiers``, ``ckptd ls --daemon``)."""
        return [{k: v for k, v in d.items() if k != "keys"} for d in self.describe(root)]


def _sealed(data: bytes):
    """``data`` in a sealed buffer (``server.sealed``; a ``bytearray`` where memfds are not
    available). OSError when no descriptor or memory is left."""
    buf = new_buffer(len(data))
    buf[: len(data)] = data
    return seal(buf)
