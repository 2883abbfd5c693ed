"""Re-read every chunk of a committed checkpoint and check it.

Checks that the commit record, the manifest, the step's newest claim and the done records all
name one attempt (``ckptd.commit.check_consistency``: a step mixed by two writers fails). Where
the commit record has pins (``ckptd.pins``): the done records' pins sum to the commit's, every
metadata object matches its sha256 and every shard object its size and the crc32c (and, in done
records since issue 36, the BLAKE3) of each of its parts as the committing attempt wrote them
(an object replaced after the commit by another attempt's, validly encoded, or rewritten with
bytes that keep its crc32c, fails here and nowhere else). Then, per array: ``zarr.json``
exists and matches the manifest; every shard object of the grid exists; each shard index passes
its crc32c and points inside the object; every chunk that lies inside the array is present with
the right size and passes its crc32c. Shards are read whole (one GET each) and in parallel.
Stops at the first bad array unless ``keep_going``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ckptd import catalog, commit, fencing
from ckptd import manifest as mf
from ckptd import pins as pinsmod
from ckptd.codec import (
    CRC_BYTES,
    DIGEST_BYTES,
    EMPTY,
    ArrayLayout,
    check_chunk,
    check_metadata,
    decode_index,
    max_object_bytes,
    part_digest,
)
from ckptd.errors import CheckpointError, CorruptChunkError
from ckptd.layout import chunk_box
from storage_backends import NotFoundError, StorageError, Store

__all__ = ["VerifyReport", "check_object", "verify"]

log = logging.getLogger("ckptd.verify")


@dataclass
class VerifyReport:
    step: int
    arrays: int = 0
    objects: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    # what does not make the step bad but should be known: objects no committed attempt owns
    warnings: list[str] = field(default_factory=list)
    judged: str | None = None  # judged_digest() of the step when verify began (what a record binds)

    @property
    def ok(self) -> bool:
        return not self.errors


def _check_pin(layout: ArrayLayout, mv: memoryview, pin: tuple[int, bytes, bytes], name: str, key: str) -> None:
    """The object against its pin (``ckptd.pins``): its size, the crc32c stored after each part
    (chunks back to back in storage order, then the index) against the ones written, then each
    part's BLAKE3 against its pin (done records since issue 36: the crc32c is linear, 4 bytes
    make other contents keep it)."""
    size, crcs, digests = pin
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
    bounds = [(k * n, n) for k in range(parts)]
    if layout.sharded:
        bounds.append((mv.nbytes - layout.index_nbytes, layout.index_nbytes))
    for k, (off, length) in enumerate(bounds if digests else ()):
        if part_digest(mv[off : off + length]) != digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]:
            part = "its index" if layout.sharded and k == parts else f"its chunk #{k}"
            raise CorruptChunkError(
                f"{name}: object {key} differs from what its committing attempt wrote ({part}: BLAKE3 pinned in the "
                "done record differs; the object was replaced after the commit)"
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
    check_object(layout, mv, coord, name)  # the object's own structure and crc32c first, then
    if pin is not None:  # what only the pins catch: another attempt's valid object
        _check_pin(layout, mv, pin, name, key)
    return len(data)


def check_object(layout: ArrayLayout, mv: memoryview, coord: tuple[int, ...], name: str, strict: bool = True) -> None:
    """What object ``coord`` says of itself: a chunk's crc32c, or a shard's index and each chunk's
    bounds and crc32c; ``strict`` (verify, not ``ckptd.open``) also refuses a chunk of the array
    absent from its shard or not where the format puts it."""
    if not layout.sharded:
        check_chunk(layout, mv, name)
        return
    if mv.nbytes < layout.index_nbytes:
        raise CorruptChunkError(f"{name}: object of {mv.nbytes} bytes is shorter than its index")
    index = decode_index(layout, bytes(mv[-layout.index_nbytes :]), name)
    body = mv.nbytes - layout.index_nbytes
    start, stop = layout.shard_box(coord)
    present = tuple(-(-(b - a) // c) for a, b, c in zip(start, stop, layout.chunk_shape, strict=True))
    for c in itertools.product(*map(range, layout.chunks_per_shard)):
        off, n = (int(x) for x in index[c])
        if off == EMPTY and n == EMPTY:
            if strict and chunk_box(layout, coord, c).volume > 0:  # the chunk lies (partly) inside the array
                raise CorruptChunkError(f"{name} chunk {c}: absent from the shard")
            continue
        if off + n > body or n != layout.chunk_nbytes + CRC_BYTES:
            raise CorruptChunkError(f"{name} chunk {c}: index entry ({off}, {n}) is out of bounds")
        if strict and off != int(np.ravel_multi_index(c, present)) * n:
            raise CorruptChunkError(
                f"{name} chunk {c}: at offset {off}, not where the format puts it (chunks of a shard "
                "are stored back to back in C order); the shard was rewritten by another tool"
            )
        check_chunk(layout, mv[off : off + n], f"{name} chunk {c}")


def verify(
    store: Store,
    step: int | None = None,
    *,
    threads: int = 8,
    keep_going: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    step = catalog.resolve_step(store, step)
    judged = judged_digest(store, step)
    m = catalog.load_manifest(store, step)
    prefix = mf.step_dir(m.step)
    where = catalog.where(store, m.step)
    report = VerifyReport(m.step, judged=judged)
    try:
        report.errors += commit.check_consistency(store, m.step, m)
    except (StorageError, CheckpointError) as e:
        report.errors.append(f"{where}: cannot check the commit records ({e})")
    pins = rec = None  # a step committed before pins: its objects are checked by their own crc32c only
    try:
        rec = catalog.read_commit(store, m.step)
        if pinsmod.commit_digest(rec) is not None:
            with ThreadPoolExecutor(threads) as pool:  # every done record's pins, their sum checked
                pins = pinsmod.read_all(store, m.step, rec, where, pool)
    except (StorageError, CheckpointError) as e:
        report.errors.append(f"{where}: cannot check the pins of the committing attempt ({e})")
    # Objects the committing attempt does not own (``fencing.unowned``: a superseded attempt's
    # leftovers or late writes) are warnings. An unreadable commit record, or one naming no
    # attempt, is already one of the step's errors (above, ``check_consistency``).
    if isinstance((rec or {}).get("attempt"), str):
        try:
            stray = fencing.unowned(store, m, rec["attempt"])
            report.warnings += [
                f"{where}: {k!r}: an object no committed attempt owns (a superseded writer's)" for k in stray
            ]
        except (StorageError, CheckpointError) as e:
            report.warnings.append(f"{where}: cannot list the step's objects ({e})")
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
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_check_shard, store, prefix, e, c, where, pins) for e, c in tasks]
        try:
            for done, f in enumerate(futures, 1):
                try:
                    report.bytes += f.result()
                    report.objects += 1
                except CheckpointError as e:
                    report.errors.append(str(e))
                    if not keep_going:
                        break
                if progress:
                    progress(done, len(tasks))
        finally:
            # On the first error, or Ctrl-C, drop the queued shards so that leaving the pool waits
            # only for the few being read instead of re-reading the whole checkpoint.
            pool.shutdown(wait=False, cancel_futures=True)
    return report


# -------------------------------------------------------------------------- verification records
#
# ``ckptd verify`` leaves its verdict beside the checkpoint it checked, in ``_verify.json`` of
# the step folder, written after the commit and never part of it: the commit record counts the
# bytes of the done records, readers and ``verify`` go through the manifest, so nothing reads
# this file but ``ls``, ``gc``, the daemon's status page and ``restore(fallback=True)``.
#
# Invariants (issue 27 item 3):
# - A verdict is bound to the bytes it judged: ``judged`` is the sha256 of the step's commit
#   record and manifest as ``verify`` read them before checking. A record whose ``judged`` is not
#   the digest of the step's current commit record and manifest (a record left by an earlier
#   checkpoint of the same step number, quarantined then saved again; one copied from another
#   step; one whose records were replaced since) is ignored: the step reads as unverified.
# - A record is parsed strictly (every field present, of its type, within its bounds); a
#   malformed one is ignored with one WARNING, never a KeyError or TypeError in a caller.
# - The binding is no signature: whoever can read the step and put objects under it can write a
#   matching record. So nothing destructive trusts an "ok": ``gc`` keeps what it would keep with no
#   record at all (``ckptd.retention``), and a record can only make it keep more.

RECORD = "_verify.json"
MAX_RECORD_ERRORS = 5
MAX_ERROR_CHARS = 4096
_DIGEST_HEX = 64
_warned: set[tuple[str, int]] = set()  # (root, step) whose malformed record was already logged
_MAX_WARNED = 4096


def record_key(step: int) -> str:
    return f"{mf.step_dir(step)}/{RECORD}"


def judged_digest(store: Store, step: int) -> str | None:
    """sha256 over the step's commit record and manifest bytes (each length-prefixed; a missing
    or oversized manifest as a marker of its own, so a step whose manifest is gone can still be
    recorded bad), or None when the commit record is missing or either cannot be read: what a
    verdict on ``step`` is bound to."""
    prefix = mf.step_dir(step)
    h = hashlib.sha256()
    try:
        data = store.get(f"{prefix}/{mf.COMMIT}", limit=mf.MAX_RECORD_BYTES)
        h.update(len(data).to_bytes(8, "big") + data)
        try:
            data = store.get(f"{prefix}/{mf.MANIFEST}", limit=mf.MAX_MANIFEST_BYTES)
            h.update(len(data).to_bytes(8, "big") + data)
        except NotFoundError:
            h.update(b"\xff" * 8 + b"manifest missing")
        except (StorageError, CheckpointError):  # oversized, a special file, or storage failing:
            h.update(b"\xff" * 8 + b"manifest unreadable")  # void once it reads again
    except (NotFoundError, StorageError, CheckpointError):
        return None
    return h.hexdigest()


def write_record(store: Store, report: VerifyReport) -> dict:
    """Record ``report`` for its step; returns the record. Raises CheckpointError when the step
    is no longer committed (quarantined or deleted meanwhile) or its records changed since
    ``verify`` read them: a verdict needs the commit it judged."""
    judged = judged_digest(store, report.step)
    where = catalog.where(store, report.step)
    if judged is None:
        raise CheckpointError(f"{where}: no longer committed; verdict not recorded")
    if report.judged is not None and report.judged != judged:
        raise CheckpointError(f"{where}: commit record or manifest changed while verifying; verdict not recorded")
    commit = catalog.read_commit(store, report.step) or {}
    rec = {
        "step": report.step,
        "ok": report.ok,
        "judged": judged,
        "attempt": commit.get("attempt") if isinstance(commit.get("attempt"), str) else None,
        "time": time.time(),
        "arrays": report.arrays,
        "objects": report.objects,
        "bytes": report.bytes,
        "errors": [e[:MAX_ERROR_CHARS] for e in report.errors[:MAX_RECORD_ERRORS]],
    }
    try:
        store.put(record_key(report.step), mf.dumps(rec))
    except StorageError as e:
        raise CheckpointError(f"{where}: cannot record the verdict ({e})") from None
    return rec


def _malformed(rec: object, step: int) -> str | None:
    """What is wrong with a parsed record, or None."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("step") != step or not mf.is_count(rec.get("step")):
        return f"names step {rec.get('step')!r}"
    if not isinstance(rec.get("ok"), bool):
        return "'ok' is not true or false"
    judged = rec.get("judged")
    if not isinstance(judged, str) or len(judged) != _DIGEST_HEX or any(c not in "0123456789abcdef" for c in judged):
        return "no valid 'judged' digest"
    t = rec.get("time")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1e11:
        return "'time' is not a time"
    for k in ("arrays", "objects", "bytes"):
        if not mf.is_count(rec.get(k)):
            return f"{k!r} is not a count"
    errors = rec.get("errors")
    if not isinstance(errors, list) or len(errors) > MAX_RECORD_ERRORS:
        return "'errors' is not a list of at most 5 messages"
    if not all(isinstance(e, str) and len(e) <= MAX_ERROR_CHARS for e in errors):
        return "'errors' holds something other than messages"
    if rec["ok"] == bool(errors):
        return "'ok' disagrees with 'errors'"
    return None


def _warn_once(store: Store, step: int, why: str) -> None:
    key = (store.uri, step)
    if key in _warned:
        return
    if len(_warned) >= _MAX_WARNED:
        _warned.clear()
    _warned.add(key)
    log.warning("%s/%s: ignoring the verify record: %s", catalog.where(store, step), RECORD, why)


def read_record(store: Store, step: int) -> dict | None:
    """The verdict recorded for ``step``'s current commit record and manifest (as stored), or
    None: never verified, unreadable, malformed, or bound to other bytes."""
    try:
        rec = mf.read_json(store, record_key(step), catalog.where(store, step), "verify record")
    except NotFoundError:
        return None
    except (StorageError, CheckpointError, ValueError) as e:
        _warn_once(store, step, str(e))
        return None
    if isinstance(rec, dict) and "judged" not in rec and "commit_time" in rec:
        return None  # written by a ckptd before verdicts were bound to bytes: unverified, quietly
    why = _malformed(rec, step)
    if why is not None:
        _warn_once(store, step, why)
        return None
    if rec["judged"] != judged_digest(store, step):
        return None  # a verdict on other bytes: this commit is unverified
    return rec


def status(store: Store, step: int) -> str:
    """``ok``, ``bad`` or ``unverified``: what ``ckptd ls`` shows in its VERIFIED column."""
    rec = read_record(store, step)
    return "unverified" if rec is None else "ok" if rec["ok"] else "bad"
