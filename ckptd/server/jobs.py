"""Handed-off snapshots: validate them, upload them with the one commit protocol, watch commits.

A job is one rank's part of one checkpoint, as ``trainer_hooks.snapshot.SaveJob`` describes it,
with its buffers in files of a staging lease. The daemon maps those files and calls
``trainer_hooks.writer.persist`` -- the same code, hence the same order of writes, as the
in-process writer: shards and metadata, then the rank's done record, then ``try_commit``
(``put_if_absent`` of the commit record, so two daemons racing on one step commit it once).

States: ``queued`` -> ``uploading`` -> ``uploaded`` (this rank's data and done record are durable;
other ranks still to finish) -> ``committed``; or ``failed``; or ``discarded`` (at restart, when
its files did not survive). Upload concurrency is bounded by ``upload_workers`` jobs and
``io_threads`` puts; commits of ``uploaded`` jobs are watched by one thread, so no upload worker
sits idle waiting for other nodes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import stat
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, numpy_dtype
from ckptd.errors import CheckpointError
from ckptd.server.metrics import Metrics
from ckptd.server.roots import RootError, Roots
from ckptd.server.settings import Settings
from ckptd.server.staging import Lease, LeaseBusy, Staging, is_plain_file_name
from storage_backends import StorageError, Store, open_store
from storage_backends.base import InvalidKeyError, check_key
from trainer_hooks.flatten import torch_dtype
from trainer_hooks.snapshot import SaveJob, ShardWrite
from trainer_hooks.writer import persist

log = logging.getLogger("ckptd.jobs")

ATTEMPT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JOB_ID = re.compile(r"^[0-9a-f]{8,64}$")
MAX_META_BYTES = 1 << 30
FINAL = ("committed", "failed", "discarded")


class BadJob(ValueError):
    """The hand-off is malformed or names something outside its root or lease: HTTP 400."""


@dataclass
class Job:
    job: str
    lease: str
    root: str
    step: int
    attempt: str
    rank: int
    world_size: int
    shards: list[dict]
    metadata: list[dict]
    done: dict
    keep_last: int | None = None
    commit_timeout: float = 1800.0
    state: str = "queued"
    error: str | None = None
    accepted_at: float = field(default_factory=time.time)
    uploaded_at: float | None = None
    committed_at: float | None = None
    bytes_written: int = 0
    objects_written: int = 0
    committed_here: bool = False
    retries: int = 0
    upload_seconds: float = 0.0

    def journal(self) -> dict:
        return asdict(self)

    def status(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("shards", "metadata", "done")}
        d["shard_count"] = len(self.shards)
        d["bytes_staged"] = sum(s["nbytes"] for s in self.shards)
        if self.committed_at is not None:
            d["handoff_to_commit_s"] = self.committed_at - self.accepted_at
        return d


# ----------------------------------------------------------------------------- validation


def _check_store_key(folder: str, key: str, what: str) -> None:
    try:
        check_key(f"{folder}/{key}")
    except InvalidKeyError:
        raise BadJob(f"{what} {key!r} escapes the checkpoint folder or is malformed") from None


def _file_size(lease: Lease, name: str, what: str) -> int:
    if not isinstance(name, str) or not is_plain_file_name(name):
        raise BadJob(f"{what}: file {name!r} must be a plain file name inside the staging lease {lease.dir}")
    try:
        st = os.lstat(lease.dir / name)
    except FileNotFoundError:
        raise BadJob(f"{what}: staging file {name!r} does not exist in {lease.dir}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadJob(f"{what}: staging file {name!r} is not a regular file")
    return st.st_size


def validate(req: dict, lease: Lease, roots: Roots, job_id: str | None = None) -> Job:
    """A ``Job`` from a hand-off request (already shape-checked by the API model); BadJob if it
    names a root not served, keys escaping the checkpoint folder, or files outside its lease or
    of the wrong size."""
    try:
        roots.check(req["root"])
    except RootError as e:
        raise BadJob(str(e)) from None
    if req["root"] != lease.root:
        raise BadJob(f"job root {req['root']!r} differs from the lease's root {lease.root!r}")
    try:
        folder = mf.step_dir(req["step"])
    except CheckpointError as e:
        raise BadJob(str(e)) from None
    if not 0 <= req["rank"] < req["world_size"]:
        raise BadJob(f"rank {req['rank']} is outside world size {req['world_size']}")
    if not ATTEMPT.match(req["attempt"]):
        raise BadJob(f"invalid attempt id {req['attempt']!r}")
    shards = []
    for s in req["shards"]:
        lay = s["layout"]
        try:
            layout = ArrayLayout(
                tuple(lay["shape"]), lay["dtype"], tuple(lay["shard_shape"]), tuple(lay["chunk_shape"])
            )
            numpy_dtype(layout.dtype)
        except (ValueError, TypeError, CheckpointError) as e:
            raise BadJob(f"array {s['key']!r}: invalid layout ({e})") from None
        coord = tuple(s["coord"])
        if len(coord) != len(layout.shape) or not all(
            0 <= c < g for c, g in zip(coord, layout.grid_shape, strict=True)
        ):
            raise BadJob(f"array {s['key']!r}: shard {list(coord)} is outside its grid {list(layout.grid_shape)}")
        _check_store_key(folder, f"{mf.array_path(s['key'])}/{layout.shard_key(coord)}", "array key")
        start, stop = layout.shard_box(coord)
        nbytes = math.prod(b - a for a, b in zip(start, stop, strict=True)) * layout.itemsize
        size = _file_size(lease, s["file"], f"array {s['key']!r} shard {list(coord)}")
        if size != nbytes:
            raise BadJob(f"array {s['key']!r} shard {list(coord)}: staging file has {size} bytes, expected {nbytes}")
        shards.append({"key": s["key"], "layout": lay, "coord": list(coord), "file": s["file"], "nbytes": nbytes})
    metadata = []
    for m in req["metadata"]:
        key = m["key"]
        _check_store_key(folder, key, "metadata key")
        if key == mf.COMMIT or key.startswith(f"{mf.DONE}/"):
            raise BadJob(f"metadata key {key!r} is reserved for the commit protocol")
        size = _file_size(lease, m["file"], f"metadata {key!r}")
        if size > MAX_META_BYTES:
            raise BadJob(f"metadata {key!r} is {size} bytes, more than {MAX_META_BYTES}")
        metadata.append({"key": key, "file": m["file"], "nbytes": size})
    return Job(
        job=job_id or uuid.uuid4().hex,
        lease=lease.id,
        root=req["root"],
        step=req["step"],
        attempt=req["attempt"],
        rank=req["rank"],
        world_size=req["world_size"],
        shards=shards,
        metadata=metadata,
        done=req.get("done") or {},
        keep_last=req.get("keep_last"),
        commit_timeout=float(req.get("commit_timeout") or 1800.0),
    )


def _map(path: Path, nbytes: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor over a mapping of it (no copy). O_NOFOLLOW: a file
    swapped for a symlink after validation is refused, never followed."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            raise CheckpointError(f"staging file {path} changed after hand-off ({st.st_size} bytes, expected {nbytes})")
        # Private and writable (never written): numpy and torch want writable memory, and a
        # read-only fd is enough, so the daemon needs no write permission on trainers' files.
        mm = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def load(job: Job, folder: Path) -> SaveJob:
    """The ``SaveJob`` that ``persist`` writes, its buffers mapped from the staging files."""
    out = SaveJob(job.step, job.attempt, job.rank, job.world_size, done=dict(job.done))
    for s in job.shards:
        lay = s["layout"]
        layout = ArrayLayout(tuple(lay["shape"]), lay["dtype"], tuple(lay["shard_shape"]), tuple(lay["chunk_shape"]))
        start, stop = layout.shard_box(s["coord"])
        shape = tuple(b - a for a, b in zip(start, stop, strict=True))
        buf = _map(folder / s["file"], s["nbytes"]).view(torch_dtype(layout.dtype)).view(shape)
        out.shards.append(ShardWrite(s["key"], layout, tuple(s["coord"]), buf))
    for m in job.metadata:
        out.metadata.append((m["key"], (folder / m["file"]).read_bytes()))
    return out


def intact(job: Job, folder: Path) -> str | None:
    """None if every file of the job is there with its size, else what is wrong."""
    for f in [*job.shards, *job.metadata]:
        try:
            st = os.lstat(folder / f["file"])
        except OSError:
            return f"staging file {f['file']} is missing"
        if not stat.S_ISREG(st.st_mode) or st.st_size != f["nbytes"]:
            return f"staging file {f['file']} has {st.st_size} bytes, expected {f['nbytes']}"
    return None


class _Delayed:
    """Test-only fault injection (``CKPTD_FAULT_UPLOAD_DELAY_S``): every shard put sleeps first."""

    def __init__(self, store: Store, delay: float):
        self._store, self._delay = store, delay

    def put(self, key, data):
        if f"/{mf.ARRAYS}/" in key:
            time.sleep(self._delay)
        return self._store.put(key, data)

    def __getattr__(self, name):
        return getattr(self._store, name)


# -------------------------------------------------------------------------------- runner


class Runner:
    """Accepts jobs, uploads them on a bounded pool and watches their commits."""

    HISTORY = 4096  # finished jobs remembered for status queries

    def __init__(self, settings: Settings, roots: Roots, staging: Staging, metrics: Metrics):
        self.settings = settings
        self.roots = roots
        self.staging = staging
        self.metrics = metrics
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._stores: dict[str, Store] = {}
        self._pool = ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="ckptd-upload")
        self._io = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="ckptd-io")
        self._watching: dict[str, float] = {}  # job id -> next check (monotonic)
        self._stop = threading.Event()
        self._pending = 0  # queued or running
        self._running = 0
        self._thread = threading.Thread(target=self._loop, name="ckptd-watch", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- public

    def store(self, root: str) -> Store:
        with self._lock:
            st = self._stores.get(root)
            if st is None:
                st = self._stores[root] = open_store(root)
            return st

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def recent(self, limit: int = 100) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())[-limit:]

    @property
    def queue_depth(self) -> int:
        """Jobs accepted whose upload has not finished."""
        with self._lock:
            return self._pending

    @property
    def watching(self) -> int:
        with self._lock:
            return len(self._watching)

    def accept(self, req: dict) -> Job:
        """Validate a hand-off, journal it and queue its upload. From the return on, the
        daemon owns the files: the client may die."""
        lease = self.staging.get(req["lease"])
        job_id = req.get("job")
        if job_id is not None:
            if not JOB_ID.match(job_id):
                raise BadJob(f"invalid job id {job_id!r}")
            known = self.get(job_id)
            if known is not None:  # the client retried a hand-off that had gone through
                if known.lease != lease.id:
                    raise BadJob(f"job id {job_id} is already taken")
                return known
        if lease.owner != "client":
            raise LeaseBusy(f"lease {lease.id} already carries job {lease.job}")
        job = validate(req, lease, self.roots, job_id)
        self.staging.hand_off(lease.id, job.job, job.journal() | {"state": "accepted"})
        self._remember(job)
        self.metrics.inc("ckptd_jobs_accepted_total")
        log.info("accepted job %s: %s step %d rank %d/%d", job.job, job.root, job.step, job.rank, job.world_size)
        self._enqueue(job)
        return job

    def recover(self) -> None:
        """Resume or discard what a previous daemon journalled in the staging folder."""
        for lease, rec in self.staging.recover():
            if rec is None:
                continue
            try:
                job = Job(**{k: v for k, v in rec.items() if k in Job.__dataclass_fields__})
            except TypeError as e:
                log.warning("staging lease %s: unreadable job journal (%s); freeing it", lease.id, e)
                self.staging.discard(lease.id)
                continue
            state = rec.get("state")
            if state == "accepted":
                self._recover_accepted(job, lease)
            elif state == "uploaded":
                job.state = "uploaded"
                self._remember(job)
                with self._lock:
                    self._watching[job.job] = 0.0
            else:
                self._remember(job)

    def close(self, grace_s: float = 30.0) -> None:
        """Stop: finish running uploads for up to ``grace_s``; what is left resumes at restart."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        while self._running and time.monotonic() < deadline:
            time.sleep(0.05)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=2)
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for st in stores:
            with contextlib.suppress(Exception):
                st.close()

    # ------------------------------------------------------------------------ internals

    def _remember(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.job] = job
            self._jobs.move_to_end(job.job)
            while len(self._jobs) > self.HISTORY:
                oldest = next(iter(self._jobs.values()))
                if oldest.state not in FINAL:
                    break
                self._jobs.popitem(last=False)

    def _enqueue(self, job: Job) -> None:
        with self._lock:
            self._pending += 1
        self._pool.submit(self._run, job)

    def _recover_accepted(self, job: Job, lease: Lease) -> None:
        why = None
        try:
            self.roots.check(job.root)
        except RootError as e:
            why = str(e)
        if why is None:
            why = intact(job, lease.dir)
        if why is None:
            why = self._superseded(job)
        if why is None:
            log.warning(
                "resuming job %s after a restart: %s step %d rank %d (its staged files are intact)",
                job.job,
                job.root,
                job.step,
                job.rank,
            )
            job.state = "queued"
            self._remember(job)
            self.metrics.inc("ckptd_jobs_recovered_total")
            self._enqueue(job)
            return
        log.warning(
            "discarding job %s after a restart: %s step %d rank %d: %s", job.job, job.root, job.step, job.rank, why
        )
        job.state, job.error = "discarded", f"discarded after a daemon restart: {why}"
        self._remember(job)
        self.metrics.inc("ckptd_jobs_discarded_total")
        self.staging.discard(lease.id)

    def _superseded(self, job: Job) -> str | None:
        """Why a journalled job must not be finished: its step committed, or a newer attempt
        of the same step started (its shards would overwrite that attempt's)."""
        try:
            store = self.store(job.root)
            commit = catalog.read_commit(store, job.step)
            if commit is not None:
                return None if commit.get("attempt") == job.attempt else "the step was committed by another attempt"
            prefix = f"{mf.step_dir(job.step)}/{mf.DONE}/"
            attempts = {o.key[len(prefix) :].split("/", 1)[0] for o in store.list(prefix)}
            if attempts - {job.attempt}:
                return "a newer attempt of the same step has started"
        except (StorageError, CheckpointError) as e:
            return f"cannot check its checkpoint folder ({e})"
        if time.time() - job.accepted_at > job.commit_timeout:
            return f"accepted more than its commit timeout ({job.commit_timeout:.0f} s) ago"
        return None

    def _run(self, job: Job) -> None:
        with self._lock:
            self._running += 1
        try:
            self._upload(job)
        except Exception as e:  # noqa: BLE001 - a job's failure must never kill the worker
            if self._stop.is_set():
                log.warning("job %s interrupted by shutdown; a restart resumes it", job.job)
            else:
                log.exception("job %s failed unexpectedly", job.job)
                self._finish(job, "failed", f"internal error: {e!r}")
        finally:
            with self._lock:
                self._pending -= 1
                self._running -= 1

    def _upload(self, job: Job) -> None:
        lease = self.staging.get(job.lease)
        job.state = "uploading"
        store: Any = self.store(job.root)
        if self.settings.fault_upload_delay_s > 0:
            store = _Delayed(store, self.settings.fault_upload_delay_s)
        commit = catalog.read_commit(store, job.step)
        result, err = None, None
        if commit is not None and commit.get("attempt") == job.attempt:
            result = "already"  # a restart after the commit but before the journal said so
        for attempt in range(self.settings.upload_retries + 1):
            if result is not None or self._stop.is_set():
                break
            t0 = time.perf_counter()
            try:
                save_job = load(job, lease.dir)
                try:
                    result = persist(store, save_job, self._io, job.keep_last, job.commit_timeout, wait=False)
                finally:
                    del save_job  # unmap the staging files
            except (OSError, CheckpointError, StorageError) as e:
                err = e
                if isinstance(e, OSError | CheckpointError) and intact(job, lease.dir) is not None:
                    break  # the files are gone: retrying cannot help
                if attempt < self.settings.upload_retries:
                    self.metrics.inc("ckptd_upload_retries_total")
                    job.retries += 1
                    log.warning("job %s: upload failed (%s); retrying", job.job, e)
                    time.sleep(min(0.5 * 2**attempt, 5.0))
            finally:
                job.upload_seconds += time.perf_counter() - t0
        if result is None:
            if self._stop.is_set() and err is None:
                return  # shutting down: the journal still says accepted; a restart resumes it
            self.staging.uploaded(job.lease, job.journal() | {"state": "failed", "error": str(err)})
            self._finish(job, "failed", str(err))
            return
        job.uploaded_at = time.time()
        if result != "already":
            job.bytes_written, job.objects_written = result.bytes_written, result.objects_written
            job.committed_here = result.committed_here
            self.metrics.inc("ckptd_bytes_written_total", result.bytes_written)
            self.metrics.inc("ckptd_objects_written_total", result.objects_written)
            self.metrics.inc("ckptd_upload_seconds_total", job.upload_seconds)
            if job.upload_seconds > 0:
                self.metrics.set_last(
                    "ckptd_upload_throughput_bytes_per_second", result.bytes_written / job.upload_seconds
                )
            if result.committed_here:
                self.metrics.inc("ckptd_commits_written_total")
        self.staging.uploaded(job.lease, job.journal() | {"state": "uploaded"})
        if result == "already" or result.committed_here:
            self._finish(job, "committed")
        else:
            job.state = "uploaded"
            with self._lock:
                self._watching[job.job] = 0.0

    def _finish(self, job: Job, state: str, error: str | None = None) -> None:
        job.state, job.error = state, error
        if state == "committed":
            job.committed_at = time.time()
            self.metrics.inc("ckptd_jobs_committed_total")
            self.metrics.inc("ckptd_handoff_to_commit_seconds_sum", job.committed_at - job.accepted_at)
            self.metrics.inc("ckptd_handoff_to_commit_seconds_count")
            log.info(
                "job %s: %s step %d committed, %.3f s after hand-off",
                job.job,
                job.root,
                job.step,
                job.committed_at - job.accepted_at,
            )
        else:
            self.metrics.inc("ckptd_jobs_failed_total")
            log.error("job %s: %s step %d rank %d failed: %s", job.job, job.root, job.step, job.rank, error)
        self.staging.journal(job.lease, job.job, job.journal())

    def _loop(self) -> None:
        """Watch commits of uploaded jobs; expire abandoned leases."""
        next_expire = 0.0
        while not self._stop.wait(0.02):
            now = time.monotonic()
            if now >= next_expire:
                self.staging.expire()
                next_expire = now + min(5.0, self.staging.ttl / 4)
            with self._lock:
                due = [j for j, t in self._watching.items() if t <= now]
            for job_id in due:
                job = self.get(job_id)
                if job is None:
                    with self._lock:
                        self._watching.pop(job_id, None)
                    continue
                try:
                    done = self._check_commit(job)
                except (StorageError, CheckpointError) as e:
                    log.warning("job %s: cannot check its commit (%s)", job.job, e)
                    done = False
                with self._lock:
                    if done:
                        self._watching.pop(job_id, None)
                    else:
                        waited = time.time() - (job.uploaded_at or job.accepted_at)
                        self._watching[job_id] = now + min(0.01 + waited / 10, 0.5)

    def _check_commit(self, job: Job) -> bool:
        commit = catalog.read_commit(self.store(job.root), job.step)
        if commit is not None:
            if commit.get("attempt") == job.attempt:
                self._finish(job, "committed")
            else:
                self._finish(job, "failed", f"step {job.step} was committed by another attempt")
            return True
        if time.time() - job.accepted_at > job.commit_timeout:
            self._finish(job, "failed", f"not committed {job.commit_timeout:.0f} s after hand-off")
            return True
        return False
