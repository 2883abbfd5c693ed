"""Pins: what the committing attempt of a step wrote, object by object, and the checks readers
make against them (issue 26: a committed step verifies itself).

Every done record pins what its rank wrote (``donetree.make_pins``: per shard object its size,
the crc32c of each part as stored and (since issue 36) each part's BLAKE3, per metadata object
its sha256); ``commit.json`` keeps
the sum of the records' pin digests and the manifest's sha256. Why it holds (only the committing
attempt writes the done records and the commit record) and who checks what (``ckptd verify``:
:func:`read_all`; ``restore``: :func:`load_manifest`, :func:`read_ranks`,
``CheckpointReader(pins=...)``): ``docs/reliability.md``, "A committed step verifies itself".

Old checkpoints: a commit record without ``pins`` (written before pins existed) means no pins
to check; such steps are read as before (each chunk's own crc32c), and a reader never asks
them for pins. Done records written before issue 36 pin no BLAKE3 (``v`` 1): their steps are
checked against the crc32c pins only, as then.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd.codec import CRC_BYTES, DIGEST_BYTES
from ckptd.errors import CheckpointError, CorruptChunkError
from storage_backends import NotFoundError, StorageError, Store

__all__ = [
    "Pins",
    "check_meta",
    "commit_digest",
    "committed",
    "load_manifest",
    "read_all",
    "read_ranks",
    "shard_pin",
]


@dataclass
class Pins:
    """The pins of (some of) a step's done records: keys are relative to the step folder."""

    # key -> (size, crc bytes, BLAKE3 pins: b"" in a done record written before issue 36)
    shards: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)  # key -> sha256 hex

    def add(self, pins: dict, where: str, key: str) -> None:
        try:
            for k, (size, crcs, *digests) in pins.get("shards", {}).items():
                raw = base64.b64decode(crcs, validate=True)
                dig = base64.b64decode(digests[0], validate=True) if digests else b""
                if type(size) is not int or size < 0 or len(raw) % CRC_BYTES or len(digests) > 1:
                    raise ValueError(f"bad pin of {k}")
                if digests and len(dig) != len(raw) // CRC_BYTES * DIGEST_BYTES:
                    raise ValueError(f"bad pin of {k}")
                self.shards[k] = (size, raw, dig)
            for k, sha in pins.get("meta", {}).items():
                if not isinstance(sha, str):
                    raise ValueError(f"bad pin of {k}")
                self.meta[k] = sha
        except (ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: done record {key} has malformed pins ({e})") from None


def commit_digest(commit: dict | None) -> int | None:
    """The pin digest the commit record keeps, or None (a step committed before pins)."""
    d = (commit or {}).get("pins")
    if not isinstance(d, str):
        return None
    try:
        return int(d, 16)
    except ValueError:
        return -1  # never equal to a sum: reported as a mismatch


def _records(store: Store, keys: list[str], where: str, pool: ThreadPoolExecutor | None) -> list[dict]:
    def load(key: str) -> dict:
        rec = mf.read_json(store, key, where, "done record")
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: done record {key} is not a JSON object")
        return rec

    return list((map if pool is None else pool.map)(load, keys))


def _rank_keys(store: Store, prefix: str, depth: int) -> dict[int, str]:
    """rank -> key of its done record ``r<rank>....json`` ``depth`` folders below ``prefix`` (the
    group folders): the first in key order (a rank that wrote its record twice counts once, as in
    the climb); a key at another depth is no rank's record."""
    out: dict[int, str] = {}
    for o in store.list(prefix):  # in key order
        parts = o.key[len(prefix) :].split("/")
        head = parts[-1].split(".", 1)[0]
        if len(parts) == depth + 1 and head.startswith("r") and head[1:].isascii() and head[1:].isdigit():
            out.setdefault(int(head[1:]), o.key)
    return out


def read_all(store: Store, step: int, commit: dict, where: str, pool: ThreadPoolExecutor | None = None) -> Pins:
    """Every done record of the committing attempt, their pins merged, after checking that
    their pin digests sum to the commit record's (CheckpointError otherwise: a done record was
    changed, added or removed after the commit). O(N) GETs: ``ckptd verify``."""
    attempt = commit.get("attempt")
    first = _rank_keys(store, f"{mf.step_dir(step)}/{mf.DONE}/{attempt}/t1/", 1)
    keys = [first[r] for r in sorted(first)]
    recs = _records(store, keys, where, pool)
    out, total = Pins(), 0
    for key, rec in zip(keys, recs, strict=True):
        d = donetree.pin_digest(rec.get("pins"))
        if d is None:
            raise CheckpointError(f"{where}: done record {key} of the committing attempt has no pins")
        total += d
        out.add(rec["pins"], where, key)
    want = commit_digest(commit)
    if total & donetree.MASK != want:
        raise CheckpointError(
            f"{where}: the done records of attempt {attempt!r} pin digest {total & donetree.MASK:016x}, "
            f"commit.json {commit.get('pins')!r}: a done record was changed after the commit"
        )
    return out


def read_ranks(
    store: Store, step: int, attempt: str, ranks: Iterable[int], where: str, pool: ThreadPoolExecutor | None = None
) -> Pins:
    """The pins of the done records of ``ranks`` only (a restore: the writers of the shards it
    reads): one LIST per group of 64 ranks touched, one GET per rank."""
    ranks = sorted(set(ranks))
    keys = []
    for g in sorted({r // donetree.FANOUT for r in ranks}):
        found = _rank_keys(store, donetree.folder(step, attempt, 1, g), 0)
        for r in ranks:
            if r // donetree.FANOUT == g:
                if r not in found:
                    raise CheckpointError(f"{where}: the done record of rank {r} of attempt {attempt!r} is missing")
                keys.append(found[r])
    out = Pins()
    for key, rec in zip(keys, _records(store, keys, where, pool), strict=True):
        if not isinstance(rec.get("pins"), dict):
            raise CheckpointError(f"{where}: done record {key} of the committing attempt has no pins")
        out.add(rec["pins"], where, key)
    return out


def shard_pin(pins: Pins, key: str, name: str) -> tuple[int, bytes, bytes]:
    """The pin of shard ``key`` (size, crc32c of each part, BLAKE3 of each part or b""):
    CorruptChunkError when no done record pins it."""
    pin = pins.shards.get(key)
    if pin is None:
        raise CorruptChunkError(f"{name}: no done record of the committing attempt pins this object")
    return pin


def check_meta(store: Store, step: int, pins: Pins, where: str) -> list[str]:
    """Every pinned metadata object against its sha256: the errors, one per object."""
    errors = []
    for key, sha in sorted(pins.meta.items()):
        limit = mf.MAX_MANIFEST_BYTES if key == mf.MANIFEST else mf.MAX_RECORD_BYTES
        try:
            data = store.get(f"{mf.step_dir(step)}/{key}", limit=limit)
        except NotFoundError:
            errors.append(f"{where}: {key} is missing")
        except StorageError as e:
            errors.append(f"{where}: {key}: unreadable ({e})")
        else:
            if hashlib.sha256(data).hexdigest() != sha:
                errors.append(f"{where}: {key} differs from what the committing attempt wrote (sha256 pin)")
    return errors


def load_manifest(store: Store, step: int) -> mf.Manifest:
    """``catalog.load_manifest`` of committed ``step``, checked against its commit record: the
    manifest's sha256 must be the one the commit recorded, and the manifest must name the
    committing attempt (CheckpointError otherwise: it was replaced after the commit). The
    manifest's ``pinned`` attribute says whether the commit has pins for the reader to check.
    A step committed before pins has neither field; only the attempt is compared then."""
    step = catalog.resolve_step(store, step)
    where = catalog.where(store, step)
    commit = catalog.read_commit(store, step) or {}
    data, m = catalog.read_manifest(store, step)  # what is wrong with it, if anything, said as before
    sha = commit.get("manifest_sha256")
    if isinstance(sha, str) and hashlib.sha256(data).hexdigest() != sha:
        raise CorruptChunkError(
            f"{where}: {mf.MANIFEST} differs from what its committing attempt wrote (sha256 in commit.json)"
        )
    if m.attempt and commit.get("attempt") not in (None, m.attempt):
        raise CorruptChunkError(
            f"{where}: {mf.MANIFEST} names attempt {m.attempt!r}, commit.json {commit.get('attempt')!r}"
        )
    m.pinned = commit_digest(commit) is not None
    return m


def committed(store: Store, step: int, threads: int = 8) -> Pins | None:
    """Every pin of committed ``step``, their sum checked against its commit record
    (:func:`read_all`), for readers of whole checkpoints (``ckptd export``, ``diff``, ``reshard
    --rechunk``); None for a step committed before pins."""
    rec = catalog.read_commit(store, step)
    if commit_digest(rec) is None:
        return None
    try:
        with ThreadPoolExecutor(threads) as pool:
            return read_all(store, step, rec, catalog.where(store, step), pool)
    except StorageError as e:  # NotFoundError included: a record listed, then gone
        raise CheckpointError(f"{catalog.where(store, step)}: cannot read the done records' pins ({e})") from None
