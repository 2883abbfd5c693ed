"""Re-read every chunk of a committed checkpoint and check it.

Checks that the commit record, the manifest, the step's newest claim and the done records all
name one attempt (``ckptd.commit.check_consistency``: a step mixed by two writers fails). Then,
per array: ``zarr.json`` exists and matches the manifest; every shard object of the grid
exists; each shard index passes its crc32c and points inside the object; every chunk that lies
inside the array is present with the right size and passes its crc32c. Shards are read whole
(one GET each) and in parallel. Stops at the first bad array unless ``keep_going``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ckptd import catalog, commit
from ckptd import manifest as mf
from ckptd.codec import CRC_BYTES, EMPTY, ArrayLayout, decode_chunk, decode_index
from ckptd.errors import CheckpointError, CorruptChunkError
from ckptd.layout import chunk_box
from storage_backends import NotFoundError, StorageError, Store

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    step: int
    arrays: int = 0
    objects: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    # what does not make the step bad but should be known: objects no committed attempt owns
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _max_object_bytes(layout: ArrayLayout) -> int:
    """The largest a shard (or plain chunk) object of this layout can be: read no more."""
    if not layout.sharded:
        return layout.chunk_nbytes + CRC_BYTES
    return math.prod(layout.chunks_per_shard) * (layout.chunk_nbytes + CRC_BYTES) + layout.index_nbytes


def _check_shard(store: Store, prefix: str, entry: mf.TensorEntry, coord: tuple[int, ...], where: str) -> int:
    layout: ArrayLayout = entry.layout
    key = f"{prefix}/{entry.path}/{layout.shard_key(coord)}"
    name = f"{where}: array {entry.path!r} shard {layout.shard_key(coord)}"
    try:
        data = store.get(key, limit=_max_object_bytes(layout))
    except NotFoundError:
        raise CorruptChunkError(f"{name}: shard object is missing") from None
    except StorageError as e:
        raise CorruptChunkError(f"{name}: unreadable ({e})") from None
    mv = memoryview(data)
    if not layout.sharded:
        decode_chunk(layout, mv, name)
        return len(data)
    if len(data) < layout.index_nbytes:
        raise CorruptChunkError(f"{name}: object of {len(data)} bytes is shorter than its index")
    index = decode_index(layout, bytes(mv[-layout.index_nbytes :]), name)
    body = len(data) - layout.index_nbytes
    start, stop = layout.shard_box(coord)
    present = tuple(-(-(b - a) // c) for a, b, c in zip(start, stop, layout.chunk_shape, strict=True))
    for c in _chunk_coords(layout):
        off, n = (int(x) for x in index[c])
        inside = chunk_box(layout, coord, c).volume > 0 and all(
            s * ss + ci * cs < dim
            for s, ss, ci, cs, dim in zip(coord, layout.shard_shape, c, layout.chunk_shape, layout.shape, strict=True)
        )
        if off == EMPTY and n == EMPTY:
            if inside:
                raise CorruptChunkError(f"{name} chunk {c}: absent from the shard")
            continue
        if off + n > body or n != layout.chunk_nbytes + CRC_BYTES:
            raise CorruptChunkError(f"{name} chunk {c}: index entry ({off}, {n}) is out of bounds")
        if off != int(np.ravel_multi_index(c, present)) * n:
            raise CorruptChunkError(
                f"{name} chunk {c}: at offset {off}, not where the format puts it (chunks of a shard "
                "are stored back to back in C order); the shard was rewritten by another tool"
            )
        decode_chunk(layout, mv[off : off + n], f"{name} chunk {c}")
    return len(data)


def _chunk_coords(layout: ArrayLayout):
    import itertools

    return itertools.product(*[range(n) for n in layout.chunks_per_shard])


def verify(
    store: Store,
    step: int | None = None,
    *,
    threads: int = 8,
    keep_going: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    m = catalog.load_manifest(store, step)
    prefix = mf.step_dir(m.step)
    where = catalog.where(store, m.step)
    report = VerifyReport(m.step)
    try:
        report.errors += commit.check_consistency(store, m.step, m)
    except (StorageError, CheckpointError) as e:
        report.errors.append(f"{where}: cannot check the commit records ({e})")
    report.warnings += _unowned_warnings(store, m, where)
    tasks = []
    for entry in m.tensors.values():
        report.arrays += 1
        try:
            meta = mf.read_json(store, f"{prefix}/{entry.path}/zarr.json", where, "zarr.json")
            if not isinstance(meta, dict):
                raise CheckpointError("not a JSON object")
            if ArrayLayout.from_metadata(meta) != entry.layout:
                report.errors.append(f"{where}: array {entry.path!r}: zarr.json disagrees with the manifest")
            elif entry.value is not None and meta.get("fill_value") != entry.value:
                report.errors.append(
                    f"{where}: array {entry.path!r}: fill_value {meta.get('fill_value')!r} of zarr.json is not "
                    f"the saved value {entry.value!r}"
                )
        except NotFoundError:
            report.errors.append(f"{where}: array {entry.path!r}: zarr.json is missing")
        except (ValueError, CheckpointError) as e:
            report.errors.append(f"{where}: array {entry.path!r}: bad zarr.json ({e})")
        if entry.layout.nbytes == 0 or entry.value is not None:
            continue  # no data, or an inline scalar (its value is in zarr.json and the manifest)
        tasks += [(entry, c) for c in entry.layout.shard_coords()]
    if report.errors and not keep_going:
        return report
    done = 0
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_check_shard, store, prefix, e, c, where) for e, c in tasks]
        try:
            for f in futures:
                try:
                    report.bytes += f.result()
                    report.objects += 1
                except CheckpointError as e:
                    report.errors.append(str(e))
                    if not keep_going:
                        break
                done += 1
                if progress:
                    progress(done, len(tasks))
        finally:
            # On the first error, or Ctrl-C, drop the queued shards so that leaving the pool waits
            # only for the few being read instead of re-reading the whole checkpoint.
            pool.shutdown(wait=False, cancel_futures=True)
    return report


def _unowned_warnings(store: Store, m: mf.Manifest, where: str) -> list[str]:
    """One warning per object of the step that its committing attempt does not own
    (``ckptd.fencing.unowned``: a superseded attempt's leftovers or late writes)."""
    from ckptd import fencing

    try:
        rec = catalog.read_commit(store, m.step) or {}
        keys = fencing.unowned(store, m, rec.get("attempt"))
    except (StorageError, CheckpointError) as e:
        return [f"{where}: cannot list the step's objects ({e})"]
    return [f"{where}: {key!r}: an object no committed attempt owns (a superseded writer's)" for key in keys]


# -------------------------------------------------------------------------- verification records
#
# ``ckptd verify`` leaves its verdict beside the checkpoint it checked, in ``_verify.json`` of
# the step folder, written after the commit and never part of it: the commit record counts the
# bytes of the done records, readers and ``verify`` go through the manifest, so nothing reads
# this file but ``ls``, ``gc`` and ``restore(fallback=True)``. It names the commit's attempt and
# time, so a record left by an earlier checkpoint of the same step number (quarantined, then
# saved again) never vouches for the new one.

RECORD = "_verify.json"
MAX_RECORD_ERRORS = 5


def record_key(step: int) -> str:
    return f"{mf.step_dir(step)}/{RECORD}"


def write_record(store: Store, report: VerifyReport) -> dict:
    """Record ``report`` for its step; returns the record. Raises CheckpointError when the step
    is no longer committed (quarantined or deleted meanwhile): a verdict needs its commit."""
    commit = catalog.read_commit(store, report.step)
    if commit is None:
        raise CheckpointError(f"{catalog.where(store, report.step)}: no longer committed; verdict not recorded")
    rec = {
        "step": report.step,
        "ok": report.ok,
        "attempt": commit.get("attempt"),
        "commit_time": commit.get("time"),
        "time": time.time(),
        "arrays": report.arrays,
        "objects": report.objects,
        "bytes": report.bytes,
        "errors": report.errors[:MAX_RECORD_ERRORS],
    }
    try:
        store.put(record_key(report.step), mf.dumps(rec))
    except StorageError as e:
        raise CheckpointError(f"{catalog.where(store, report.step)}: cannot record the verdict ({e})") from None
    return rec


def read_record(store: Store, step: int, commit: dict | None = None) -> dict | None:
    """The verdict recorded for ``step``'s current commit, or None (never verified, or the
    record is unreadable or belongs to another commit). ``commit``: the commit record if the
    caller already read it."""
    try:
        rec = mf.read_json(store, record_key(step), catalog.where(store, step), "verify record")
        commit = commit if commit is not None else catalog.read_commit(store, step)
    except (NotFoundError, StorageError, ValueError, CheckpointError):
        return None
    if not isinstance(rec, dict) or commit is None or not isinstance(rec.get("ok"), bool):
        return None
    if rec.get("attempt") != commit.get("attempt") or rec.get("commit_time") != commit.get("time"):
        return None
    return rec


def status(store: Store, step: int, commit: dict | None = None) -> str:
    """``ok``, ``bad`` or ``unverified``: what ``ckptd ls`` shows in its VERIFIED column."""
    rec = read_record(store, step, commit)
    return "unverified" if rec is None else "ok" if rec["ok"] else "bad"
