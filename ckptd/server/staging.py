"""The staging folder: leases of snapshot buffers in shared memory, the budget, the journal.

A *lease* is one folder ``<staging>/leases/<id>/`` of buffer files belonging to one trainer rank.
It is owned either by its client (the rank creates and fills its files) or by the daemon (a
handed-off job reads them). Ownership moves client -> daemon at hand-off (``hand_off``) and back
when the upload is done (``uploaded``); a client writes into its files only while it owns the
lease, so a later save can reuse the same mapped files (no new pages, no page faults) without
ever racing an upload. When another client waits for memory, the daemon frees a finished lease
instead of handing it back, and frees idle leases; a lease whose client stopped heartbeating for
``lease_ttl_s`` is freed too.

Budget: the bytes of all leases (their files, once handed off) stay under ``budget``. A request
that does not fit gets ``BudgetFull`` (HTTP 429) and the client retries, so ``save`` waits
instead of exhausting memory. It is a soft limit: a request is granted over budget when nothing
else holds memory that could be freed (one snapshot larger than the budget, or two ranks each
holding part of their first snapshot), or when a wait sees no progress for ``budget_stall_s``
(ranks of one job exchanging boundary rows while one of them waits), and that is logged.

Journal, for restart safety: ``lease.json`` (root, rank) at creation and ``job.json`` (the whole
job description and its state) written before the hand-off is acknowledged. A restarted daemon
resumes jobs journalled as ``accepted`` whose files are intact and discards the others (see
``jobs.Runner.recover``). Only one daemon may use a staging folder (a lock file says so).

Trust (docs/security.md, "Staging area"): the staging folder sits in a world-writable place
(``/dev/shm``), so it is created or adopted, every folder below opened and every staged file read
without following a link (``ckptd.server.safefiles``). Lease folders are mode 0700, 3770 with the
trainers' group (``--staging-group``: sticky, but members can read each other's files), or with
``private`` given to the uid that asked for it (0700; the daemon's journal files stay its own).

Concurrency: every public method may be called from any thread; one lock guards the lease table.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.server.safefiles import check_ancestors, open_private_dir, read_staged, write_json_atomic

__all__ = [
    "BudgetFull",
    "FILE_NAME",
    "JOB_FILE",
    "LEASE_FILE",
    "Lease",
    "LeaseBusy",
    "LeaseGone",
    "Staging",
    "folder_bytes",
    "is_plain_file_name",
]

log = logging.getLogger("ckptd.staging")

LEASE_FILE = "lease.json"
JOB_FILE = "job.json"
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LEASE_ID = re.compile(r"[0-9a-f]{16}", re.ASCII)
_WAITER_STALE_S = 5.0  # a refused client that has not asked again for this long has gone


class BudgetFull(Exception):
    def __init__(self, staged: int, budget: int, need: int):
        super().__init__(f"staging budget full: {staged} of {budget} bytes staged, {need} more requested")
        self.staged, self.budget, self.need = staged, budget, need


class LeaseGone(KeyError):
    """No such lease (never existed, or freed): HTTP 404."""


class LeaseBusy(Exception):
    """The daemon still reads the lease's files for a job: HTTP 409."""


@dataclass
class Lease:
    id: str
    dir: Path
    root: str
    rank: int
    bytes: int
    owner: str = "client"  # "client" or "daemon"
    active: bool = False  # the client acquired it for a save in progress
    touched: float = field(default_factory=time.monotonic)
    release_after_job: bool = False
    job: str | None = None
    started_at: float = field(default_factory=time.time)  # the save in it began (create or acquire)
    uid: int | None = None  # who created it (SO_PEERCRED); None: a trusted TCP caller

    def info(self, ttl: float) -> dict:
        return dict(lease=self.id, dir=str(self.dir), bytes=self.bytes, owner=self.owner, job=self.job, ttl_s=ttl)


def is_plain_file_name(name: str) -> bool:
    return bool(FILE_NAME.match(name)) and name not in (LEASE_FILE, JOB_FILE)


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files of a lease folder (symlinks and journal files not counted)."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:
        for e in it:
            if e.name in (LEASE_FILE, JOB_FILE) or e.name.startswith("."):
                continue
            st = e.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


class Staging:
    """``group``: the trainers' group id when they run as other users than the daemon; None: one
    user for both. ``private``: lease folders are given to the uid that creates them."""

    def __init__(
        self,
        folder: Path,
        budget: int,
        lease_ttl_s: float = 60.0,
        stall_s: float = 30.0,
        group: int | None = None,
        private: bool = False,
    ):
        self.folder = Path(folder).absolute()
        self.leases_dir = self.folder / "leases"
        self.group = group
        self.private = private
        # Trainers only need to reach their own lease folder (and the socket) by path: x, no r.
        self.dir_mode = 0o710 if group is not None else 0o711 if private else 0o700
        # A folder the daemon keeps (no caller uid to give it to, or no capability to give it):
        # sticky, so that a member of the group cannot rename or delete another member's files.
        self.lease_mode = 0o3770 if group is not None else 0o700
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        check_ancestors(self.folder)
        self._root_fd = open_private_dir(self.folder, self.dir_mode, group)
        try:
            self._leases_fd = open_private_dir("leases", self.dir_mode, group, dir_fd=self._root_fd)
        except BaseException:
            os.close(self._root_fd)
            raise
        self.budget = budget
        self.ttl = lease_ttl_s
        self.stall_s = stall_s
        lock_fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._root_fd)
        self._lock_file = os.fdopen(lock_fd, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._close_fds()
            raise RuntimeError(f"another ckptd serve already uses the staging folder {self.folder}") from None
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._waiters: dict[str, tuple[float, float]] = {}  # ticket -> (first refusal, last refusal)
        self._progress = time.monotonic()  # last time memory was freed or a job moved on
        # The memory tier's copies (``server.tiers``) count against the same budget: bytes held
        # through ``reserve``; ``reclaim(nbytes) -> freed`` drops copies when a lease needs room
        # (called under this lock: it must not call back into Staging).
        self._reserved = 0
        self.reclaim: Callable[[int], int] | None = None

    # ------------------------------------------------------------------------- accounting

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return sum(lease.bytes for lease in self._leases.values())

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` of the budget for the memory tier if they fit without freeing a lease
        and without going over; False otherwise (the tier then keeps no copy: persist only)."""
        with self._lock:
            staged = sum(lease.bytes for lease in self._leases.values()) + self._reserved
            if staged + nbytes > self.budget or self._pressure(time.monotonic()):
                return False
            self._reserved += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)
            self._progress = time.monotonic()

    @property
    def lease_count(self) -> int:
        with self._lock:
            return len(self._leases)

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            return self._get(lease_id)

    def _get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseGone(f"no staging lease {lease_id!r} (freed, expired, or from before a restart)")
        return lease

    def _pressure(self, now: float) -> bool:
        for t, (_, last) in list(self._waiters.items()):
            if now - last > _WAITER_STALE_S:
                del self._waiters[t]
        return bool(self._waiters)

    def _grant(self, me: Lease | None, need: int, want: int, ticket: str) -> int:
        """Bytes granted (``want`` if it fits, else ``need``), or BudgetFull. Holds the lock."""
        now = time.monotonic()
        self._pressure(now)
        staged = sum(lease.bytes for lease in self._leases.values()) + self._reserved
        idle = [x for x in self._leases.values() if x is not me and x.owner == "client" and not x.active]
        for x in sorted(idle, key=lambda x: x.touched):
            if staged + need <= self.budget:
                break
            log.info("freeing idle lease %s (%d bytes) to make room for %d bytes", x.id, x.bytes, need)
            staged -= x.bytes
            self._free(x)
        if staged + need > self.budget and self._reserved and self.reclaim is not None:
            freed = min(self.reclaim(staged + need - self.budget), self._reserved)  # a save beats a tier copy
            self._reserved -= freed
            staged -= freed
        free = self.budget - staged
        if want <= free:
            granted = want
        elif need <= free:
            granted = need
        else:
            since = self._waiters.get(ticket, (now, now))[0]
            blockers = [
                x
                for x in self._leases.values()
                if x is not me and x.bytes > 0 and not (x.active and x.id in self._waiters)
            ]
            if not blockers or now - max(since, self._progress) >= self.stall_s:
                free_none = "nothing else holds memory that could be freed"
                why = f"no progress for {self.stall_s:.0f} s" if blockers else free_none
                log.warning(
                    "granting %d bytes over the staging budget (%d of %d staged): %s", need, staged, self.budget, why
                )
                granted = need
            else:
                self._waiters[ticket] = (since, now)
                raise BudgetFull(staged, self.budget, need)
        self._waiters.pop(ticket, None)
        return granted

    # --------------------------------------------------------------------- client requests

    def create(
        self, root: str, rank: int, need: int, want: int, ticket: str, uid: int | None = None, gid: int | None = None
    ) -> Lease:
        """A new lease of ``uid`` (None: a trusted TCP caller's). With ``private`` its folder is
        given to ``uid`` (mode 0700) once the daemon's journal file is in it."""
        with self._lock:
            granted = self._grant(None, need, max(need, want), ticket)
            lease_id = uuid.uuid4().hex[:16]
            folder = self.leases_dir / lease_id
            give = self.private and uid is not None and uid != os.geteuid()
            mode, group = (0o700, None) if give else (self.lease_mode, self.group)
            fd = open_private_dir(lease_id, mode, group, dir_fd=self._leases_fd)
            try:
                lease = Lease(lease_id, folder, root, rank, granted, active=True, uid=uid)
                write_json_atomic(
                    folder / LEASE_FILE,
                    {"lease": lease_id, "root": root, "rank": rank, "uid": uid, "created": time.time()},
                )
                if give:
                    os.fchown(fd, uid, gid if gid is not None else -1)
            except BaseException:
                os.close(fd)
                self._remove(lease_id)
                raise
            os.close(fd)
            self._leases[lease_id] = lease
            return lease

    def acquire(self, lease_id: str) -> Lease:
        """The client starts a save in its lease: it may write its files until ``hand_off``."""
        with self._lock:
            lease = self._get(lease_id)
            if lease.owner != "client":
                raise LeaseBusy(f"lease {lease_id} is still being uploaded (job {lease.job})")
            lease.active = True
            lease.touched = time.monotonic()
            lease.started_at = time.time()
            return lease

    def grow(self, lease_id: str, need: int, want: int) -> Lease:
        with self._lock:
            lease = self._get(lease_id)
            if lease.owner != "client":
                raise LeaseBusy(f"lease {lease_id} is still being uploaded (job {lease.job})")
            lease.touched = time.monotonic()
            lease.bytes += self._grant(lease, need, max(need, want), lease_id)
            return lease

    def heartbeat(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._get(lease_id)
            lease.touched = time.monotonic()
            return lease

    def release(self, lease_id: str) -> None:
        """The client is done with its lease (``Checkpointer.close``)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            if lease.owner == "client":
                self._free(lease)
            else:
                lease.release_after_job = True

    # ------------------------------------------------------------------------ daemon side

    def hand_off(self, lease_id: str, job_id: str, journal: dict) -> Lease:
        """Journal the job, then take the lease: from here on the client must not write."""
        with self._lock:
            lease = self._get(lease_id)
            if lease.owner != "client":
                raise LeaseBusy(f"lease {lease_id} already carries job {lease.job}")
            write_json_atomic(lease.dir / JOB_FILE, journal)
            lease.owner, lease.active, lease.job = "daemon", False, job_id
            lease.bytes = folder_bytes(lease.dir)  # what the snapshot really holds
            self._progress = time.monotonic()
            return lease

    def uploaded(self, lease_id: str, journal: dict) -> bool:
        """The job no longer reads the files: journal that, then hand the lease back to its client,
        or free it when its client released it or another client waits for memory. True if the
        lease was handed back."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            now = time.monotonic()
            self._progress = now
            if lease.release_after_job or self._pressure(now):
                self._free(lease)
                return False
            write_json_atomic(lease.dir / JOB_FILE, journal)
            lease.owner, lease.active, lease.touched = "client", False, now
            return True

    def journal(self, lease_id: str, job_id: str, journal: dict) -> None:
        """Best effort: record a job's final state if its lease still holds that job."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.job == job_id:
                with contextlib.suppress(OSError):
                    write_json_atomic(lease.dir / JOB_FILE, journal)

    def discard(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._free(lease)

    def leave(self, lease_id: str) -> None:
        """Stop tracking a recovered lease without touching its files (an entry this daemon must
        not act on: another daemon's, for a root it does not serve)."""
        with self._lock:
            self._leases.pop(lease_id, None)

    def expire(self) -> None:
        """Free client-owned leases whose client stopped heartbeating."""
        now = time.monotonic()
        with self._lock:
            for lease in list(self._leases.values()):
                if lease.owner == "client" and now - lease.touched > self.ttl:
                    log.info("freeing lease %s of rank %d: no heartbeat for %.0f s", lease.id, lease.rank, self.ttl)
                    self._free(lease)

    def _free(self, lease: Lease) -> None:
        self._leases.pop(lease.id, None)
        self._remove(lease.id)
        self._progress = time.monotonic()

    def _remove(self, name: str) -> None:
        """Remove one entry of ``leases/`` without following any link: a folder through
        ``rmtree(dir_fd=...)`` (which walks by descriptors), anything else by unlinking the name."""
        try:
            st = os.stat(name, dir_fd=self._leases_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=self._leases_fd)
        else:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._leases_fd)

    # ---------------------------------------------------------------------------- restart

    def recover(self) -> list[tuple[Lease, dict | None]]:
        """Adopt the leases a previous daemon left. Returns (lease, journalled job or None);
        leases without a readable ``lease.json`` are removed."""
        out = []
        with self._lock:
            for name in sorted(os.listdir(self._leases_fd)):
                folder = self.leases_dir / name
                try:
                    st = os.stat(name, dir_fd=self._leases_fd, follow_symlinks=False)
                    if not LEASE_ID.fullmatch(name) or not stat.S_ISDIR(st.st_mode):
                        raise ValueError("not a lease folder")
                    # the journal is the daemon's own file: one its tenant put there is not read
                    meta = json.loads(read_staged(folder / LEASE_FILE, owner=os.geteuid()))
                    uid = meta.get("uid")
                    if uid is not None and not isinstance(uid, int):
                        raise ValueError("malformed uid")
                    if st.st_uid != os.geteuid() and not (self.private and st.st_uid == uid):
                        raise ValueError(f"owned by uid {st.st_uid}")
                    lease = Lease(meta["lease"], folder, meta["root"], int(meta["rank"]), folder_bytes(folder), uid=uid)
                    if lease.id != name or not isinstance(lease.root, str):
                        raise ValueError("lease id does not match its folder")
                except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                    log.warning("removing unreadable staging entry %s (%s)", folder, e)
                    self._remove(name)
                    continue
                job = None
                try:  # a missing job.json is an OSError too: logged like an unreadable one
                    job = json.loads(read_staged(folder / JOB_FILE, owner=os.geteuid()))
                except (OSError, ValueError, RecursionError) as e:
                    log.warning("staging folder %s: unreadable job journal (%s); ignoring it", folder, e)
                if not isinstance(job, dict):
                    job = None
                if job is not None and job.get("state") == "accepted":
                    lease.owner, lease.job = "daemon", job.get("job")
                self._leases[lease.id] = lease
                out.append((lease, job))
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._close_fds()

    def _close_fds(self) -> None:
        self._lock_file.close()
        for fd in (self._leases_fd, self._root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
