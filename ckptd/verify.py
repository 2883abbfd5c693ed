"""Re-read every chunk of a committed checkpoint and check it.

Checks that the commit record, the manifest, the step's newest claim and the done records all
name one attempt (``ckptd.commit.check_consistency``: a step mixed by two writers fails). Where
the commit record has pins (``ckptd.pins``): the done records' pins sum to the commit's, every
metadata object matches its sha256 and every shard object its size and the crc32c of each of
its parts as the committing attempt wrote them (an object replaced after the commit by
another attempt's, validly encoded, fails here and nowhere else). Then,
per array: ``zarr.json`` exists and matches the manifest; every shard object of the grid
exists; each shard index passes its crc32c and points inside the object; every chunk that lies
inside the array is present with the right size and passes its crc32c. Shards are read whole
(one GET each) and in parallel. Stops at the first bad array unless ``keep_going``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ckptd import catalog, commit
from ckptd import manifest as mf
from ckptd import pins as pinsmod
from ckptd.codec import CRC_BYTES, EMPTY, ArrayLayout, check_metadata, decode_chunk, decode_index, max_object_bytes
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


def _check_pin(layout: ArrayLayout, mv: memoryview, pin: tuple[int, bytes], name: str, key: str) -> None:
    """The object against its pin (``ckptd.pins``): its size, and the crc32c stored after each
    part (chunks back to back in storage order, then the index) against the ones written."""
    size, crcs = pin
    if mv.nbytes != size:
        raise CorruptChunkError(
            f"{name}: object {key} is {mv.nbytes} bytes, its committing attempt wrote {size} (replaced after the "
            "commit)"
        )
    n = layout.chunk_nbytes + CRC_BYTES
    parts = (len(crcs) // CRC_BYTES) - (1 if layout.sharded else 0)
    stored = b"".join(bytes(mv[k * n + n - CRC_BYTES : k * n + n]) for k in range(parts))
    stored += bytes(mv[-CRC_BYTES:]) if layout.sharded else b""
    if stored != crcs:
        k = next(i for i in range(0, len(crcs), CRC_BYTES) if stored[i : i + CRC_BYTES] != crcs[i : i + CRC_BYTES])
        part = "its index" if layout.sharded and k // CRC_BYTES == parts else f"its chunk #{k // CRC_BYTES}"
        raise CorruptChunkError(
            f"{name}: object {key} differs from what its committing attempt wrote ({part}: crc32c pinned in the done "
            "record differs; the object was replaced after the commit)"
        )


def _check_shard(
    store: Store,
    prefix: str,
    entry: mf.TensorEntry,
    coord: tuple[int, ...],
    where: str,
    pins: pinsmod.Pins | None = None,
) -> int:
    layout: ArrayLayout = entry.layout
    key = f"{prefix}/{entry.path}/{layout.shard_key(coord)}"
    name = f"{where}: array {entry.path!r} shard {layout.shard_key(coord)}"
    pin = None if pins is None else pinsmod.shard_pin(pins, f"{entry.path}/{layout.shard_key(coord)}", name)
    try:
        data = store.get(key, limit=max_object_bytes(layout))
    except NotFoundError:
        raise CorruptChunkError(f"{name}: shard object is missing") from None
    except StorageError as e:
        raise CorruptChunkError(f"{name}: unreadable ({e})") from None
    mv = memoryview(data)
    _check_layout(layout, mv, coord, name)  # the object's own structure and crc32c first, then
    if pin is not None:  # what only the pins catch: another attempt's valid object
        _check_pin(layout, mv, pin, name, key)
    return len(data)


def _check_layout(layout: ArrayLayout, mv: memoryview, coord: tuple[int, ...], name: str) -> None:
    """The shard's index, each chunk's place and crc32c (what the object says of itself)."""
    if not layout.sharded:
        decode_chunk(layout, mv, name)
        return
    if mv.nbytes < layout.index_nbytes:
        raise CorruptChunkError(f"{name}: object of {mv.nbytes} bytes is shorter than its index")
    index = decode_index(layout, bytes(mv[-layout.index_nbytes :]), name)
    body = mv.nbytes - layout.index_nbytes
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


def _pins(store: Store, step: int, where: str, threads: int) -> pinsmod.Pins | None:
    """The pins of every done record of the committing attempt, their sum checked against the
    commit record (``ckptd.pins.read_all``); None for a step committed before pins, whose
    objects are checked by their own crc32c only. Raises CheckpointError on a mismatch."""
    rec = catalog.read_commit(store, step)
    if pinsmod.commit_digest(rec) is None:
        return None
    with ThreadPoolExecutor(threads) as pool:
        return pinsmod.read_all(store, step, rec, where, pool)


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
    pins = None
    try:
        pins = _pins(store, m.step, where, threads)
    except (StorageError, CheckpointError) as e:
        report.errors.append(f"{where}: cannot check the pins of the committing attempt ({e})")
    report.warnings += _unowned_warnings(store, m, where)
    tasks = []
    for entry in m.tensors.values():
        report.arrays += 1
        try:
            meta = mf.read_json(store, f"{prefix}/{entry.path}/zarr.json", where, "zarr.json")
            check_metadata(meta, entry.layout, entry.value)  # the codecs ckptd writes, nothing else
        except NotFoundError:
            report.errors.append(f"{where}: array {entry.path!r}: zarr.json is missing")
        except (ValueError, CheckpointError) as e:
            report.errors.append(f"{where}: array {entry.path!r}: bad zarr.json ({e})")
        if entry.layout.nbytes == 0 or entry.value is not None:
            continue  # no data, or an inline scalar (its value is in zarr.json and the manifest)
        tasks += [(entry, c) for c in entry.layout.shard_coords()]
    if pins is not None:  # after what each object says of itself: what only the pins catch
        report.errors += pinsmod.check_meta(store, m.step, pins, where)
    if report.errors and not keep_going:
        return report
    done = 0
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_check_shard, store, prefix, e, c, where, pins) for e, c in tasks]
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
