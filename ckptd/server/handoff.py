"""A hand-off: one rank's part of one checkpoint, described in JSON, its buffers in the files of
a staging lease. ``validate`` turns a request into a ``Job`` or refuses it (``BadJob``, HTTP 400):
a root not served, keys escaping the checkpoint folder or reserved for the commit protocol, file
names that are not plain names inside the lease, symlinks, files another user owns than the
lease's (``Lease.uid``: the daemon never commits bytes that another local user wrote or could
have replaced), sizes that do not match the layout.
``load`` maps the files into the ``SaveJob`` that ``ckptd.persist.persist`` writes.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, image_chunks, image_nbytes
from ckptd.dtypes import numpy_dtype
from ckptd.errors import CheckpointError
from ckptd.savejob import SaveJob, ShardWrite, format_image_np
from ckptd.server.roots import RootError, Roots
from ckptd.server.safefiles import read_staged
from ckptd.server.staging import Lease, is_plain_file_name
from storage_backends.base import InvalidKeyError, check_key

__all__ = ["ATTEMPT", "BadJob", "FINAL", "JOB_ID", "Job", "MAX_DEPTH", "MAX_META_BYTES", "intact", "load", "validate"]

ATTEMPT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JOB_ID = re.compile(r"^[0-9a-f]{8,64}$")
MAX_META_BYTES = 1 << 30
FINAL = ("committed", "held", "failed", "discarded")  # held: a memory-only step's part (server.tiers)


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
    writer: str | None = None  # the job id that claims the step (None: the attempt id)
    uid: int | None = None  # the lease's owner (who handed off); its staged files must be theirs
    commit_timeout: float = 1800.0
    memory_only: bool = False  # held in the memory tier, never written to the root (server.tiers)
    state: str = "queued"
    error: str | None = None
    error_kind: str | None = None  # a refusal's kind (a key of ``claims.REFUSALS``), else None
    accepted_at: float = field(default_factory=time.time)
    uploaded_at: float | None = None
    committed_at: float | None = None
    finished_at: float | None = None  # when it reached its final state (committed, failed, discarded)
    bytes_written: int = 0
    objects_written: int = 0
    committed_here: bool = False
    retries: int = 0
    upload_seconds: float = 0.0
    lease_kept: bool | None = None  # after the upload: handed back to the client (True) or freed
    # For the status page: seconds from the lease's acquire to this hand-off (what the trainer's
    # ``save`` spent staging, as the daemon sees it); bytes put so far; when the upload began.
    staged_s: float | None = None
    bytes_uploaded: int = 0
    upload_started_at: float | None = None

    @property
    def where(self) -> str:
        """The job's part, for logs: ``<root> step <n> rank <r>``."""
        return f"{self.root} step {self.step} rank {self.rank}"

    def journal(self) -> dict:
        """Every field, for the journal's JSON. Shallow: the shard, metadata and ``done`` lists
        are JSON values that nothing changes after validation, and ``dataclasses.asdict``
        deep-copied them (a few ms per call at hundreds of shards, on every state change)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def status(self) -> dict:
        """What a job status request answers: the scalar fields and totals, no file lists.
        Built without copying the lists: the long polls of every rank ask for it."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("shards", "metadata", "done")}
        d["shard_count"] = len(self.shards)
        d["bytes_staged"] = sum(s["nbytes"] for s in self.shards)
        d["bytes_total"] = d["bytes_staged"] + sum(m["nbytes"] for m in self.metadata)
        if self.committed_at is not None:
            d["handoff_to_commit_s"] = self.committed_at - self.accepted_at
        return d


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
    if lease.uid is not None and st.st_uid != lease.uid:
        raise BadJob(f"{what}: staging file {name!r} belongs to uid {st.st_uid}, not to the lease's uid {lease.uid}")
    return st.st_size


MAX_DEPTH = 64  # nesting of the free-form ``done`` object (RNG state is 4 deep)


def _shallow(obj, what: str):
    """``obj`` if it nests at most MAX_DEPTH levels (checked without recursion) and its numbers
    are finite and under 2^64 in magnitude (a digest's), else BadJob: a deeper one would make
    the journal's and the done record's JSON encoding recurse too far, an infinite one would
    write JSON no reader parses."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadJob(f"{what} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(x, dict):
            stack += [(v, depth + 1) for v in x.values()]
        elif isinstance(x, list):
            stack += [(v, depth + 1) for v in x]
        elif isinstance(x, float | int) and not abs(x) < 2**64:  # nan and inf fail it too
            raise BadJob(f"{what} holds a number out of range")
    return obj


def validate(req: dict, lease: Lease, roots: Roots, job_id: str | None = None) -> Job:
    """A ``Job`` from a hand-off request (already shape-checked by the API model), or BadJob."""
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
            layout = ArrayLayout.from_json(lay)
            numpy_dtype(layout.dtype)
        except (ValueError, TypeError, CheckpointError) as e:
            raise BadJob(f"array {s['key']!r}: invalid layout ({e})") from None
        coord = tuple(s["coord"])
        if len(coord) != len(layout.shape) or not all(
            0 <= c < g for c, g in zip(coord, layout.grid_shape, strict=True)
        ):
            raise BadJob(f"array {s['key']!r}: shard {list(coord)} is outside its grid {list(layout.grid_shape)}")
        _check_store_key(folder, f"{mf.array_path(s['key'])}/{layout.shard_key(coord)}", "array key")
        nbytes = math.prod(layout.shard_extent(coord)) * layout.itemsize
        image = bool(s.get("image"))
        if image:
            chunks = image_chunks(layout, coord, layout.itemsize)
            if chunks is None:
                raise BadJob(f"array {s['key']!r} shard {list(coord)}: this layout has no object image")
            nbytes = image_nbytes(layout, chunks)
        size = _file_size(lease, s["file"], f"array {s['key']!r} shard {list(coord)}")
        if size != nbytes:
            raise BadJob(f"array {s['key']!r} shard {list(coord)}: staging file has {size} bytes, expected {nbytes}")
        shard = {"key": s["key"], "layout": lay, "coord": list(coord), "file": s["file"], "nbytes": nbytes}
        if image:
            shard["image"] = True
        shards.append(shard)
    metadata = []
    for m in req["metadata"]:
        key = m["key"]
        _check_store_key(folder, key, "metadata key")
        if mf.is_reserved(key):
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
        done=_shallow(req.get("done") or {}, "done"),
        writer=req.get("writer"),
        uid=lease.uid,
        commit_timeout=float(req.get("commit_timeout") or 1800.0),
        memory_only=bool(req.get("memory_only")),
    )


def _map(path: Path, nbytes: int, owner: int | None = None) -> np.ndarray:
    """The file's bytes as a uint8 array over a mapping of it (no copy; no torch: the daemon
    runs without it). O_NOFOLLOW: a file swapped for a symlink after validation is refused,
    never followed; so is one of another user than ``owner``."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            raise CheckpointError(f"staging file {path} changed after hand-off ({st.st_size} bytes, expected {nbytes})")
        if owner is not None and st.st_uid != owner:
            raise CheckpointError(f"staging file {path} belongs to uid {st.st_uid}, not to the lease's uid {owner}")
        # Private and writable (only the image's index and checksums are written, privately): a
        # read-only fd is enough, so the daemon needs no write permission on trainers' files.
        mm = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def load(job: Job, folder: Path) -> SaveJob:
    """The ``SaveJob`` that ``persist`` writes, its buffers mapped from the staging files."""
    out = SaveJob(job.step, job.attempt, job.rank, job.world_size, done=dict(job.done))
    for s in job.shards:
        layout = ArrayLayout.from_json(s["layout"])
        coord = tuple(s["coord"])
        mapped = _map(folder / s["file"], s["nbytes"], job.uid)
        if s.get("image"):
            # The trainer laid the data out; the index and the checksums are ours to write (in
            # this private mapping), so a trainer cannot make us commit a mismatched object.
            chunks = image_chunks(layout, coord, layout.itemsize)
            view = format_image_np(mapped, layout, chunks, numpy_dtype(layout.dtype))
            out.shards.append(ShardWrite(s["key"], layout, coord, view, mapped))
            continue
        # A numpy view (bfloat16 through ml_dtypes), which is what ``persist.persist`` writes.
        buf = mapped.view(numpy_dtype(layout.dtype)).reshape(layout.shard_extent(coord))
        out.shards.append(ShardWrite(s["key"], layout, coord, buf))
    for m in job.metadata:
        out.metadata.append((m["key"], read_staged(folder / m["file"], m["nbytes"], MAX_META_BYTES, job.uid)))
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
        if job.uid is not None and st.st_uid != job.uid:
            return f"staging file {f['file']} belongs to uid {st.st_uid}, not to the lease's uid {job.uid}"
    return None
