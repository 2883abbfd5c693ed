"""Done records aggregated in a tree, so that committing N ranks costs O(N) requests and a
latency of O(log N) round trips, with no folder hotter than ``FANOUT`` ranks.

Each rank, once its data is durable, writes its done record, then climbs::

    _done/<attempt>/t1/<g>/r<rank>.<bytes>.<objects>.<digest>.<pins>.json   rank's done record
    _done/<attempt>/t2/<h>/n<g>.<bytes>.<objects>.<digest>.<pins>.json      group g of t1 is complete
    ...
    commit.json                                               the root is complete

Node ``(l, i)`` (level l >= 1) covers ranks ``[i * F**l, (i + 1) * F**l)``; its children (nodes
of level l - 1, ranks at level 0) live in the folder ``t<l>/<i>/``. A child's totals (bytes and
objects written, a sum of hashes of the shard keys written and one of the pins, :class:`Totals`) are in
its *name*, so a LIST of one folder (at most ``FANOUT`` keys: one page)
tells whether the node is complete and what it sums to, with no GET. The root is level
``L = levels(N)``, the smallest L with ``F**L >= N``; its completion is the commit.

The climb of a rank: list the folder of its node; if every child is there, write the node with
``put_if_absent`` into its parent's folder and list that one; and so on up to the root, where
``commit.json`` is written with ``put_if_absent``. A rank that finds a folder incomplete stops:
the child still missing will be written later by a rank that lists after writing it (object
stores and filesystems list what was written before), and that rank carries the climb on. A
node exists only after every child was seen, so ``commit.json`` exists only after every rank's
done record did: never partial. Several ranks may complete the same node; ``put_if_absent``
keeps one, all of them climb on (the loser's climb is redundant, never wrong), and one
``put_if_absent`` creates ``commit.json``: exactly once. Children are counted by id, not by key,
so a rank that wrote its record twice is counted once.

Above ``NOTICE_GROUP`` ranks the committer also writes a few notices after ``commit.json``
(:func:`notice_keys`) that the waiting ranks poll instead, each on its own prefix: they learn
of the commit about as fast at 8192 ranks as at 1024 (``commit.wait_commit``).

Pins (issue 26, ``ckptd.pins``): a done record also pins what its rank wrote (:func:`make_pins`),
and its name carries a sixth field, a 64-bit sum of hashes of the pins (:func:`pin_digest`),
which the tree sums like the others; the commit record stores the root's sum. Records without
pins (older writers) have five fields.

The shard digest (:func:`shard_hash`, :func:`grid_digest`) lets the committer compare the root
with the manifest in O(arrays), never walking N x A shard keys; keyed by step, attempt, array
path and arity, a record copied from another attempt never adds up, and :func:`write_done`
refuses keys spelled otherwise than grids spell them (``docs/reliability.md``).

At N = 4096 (F = 64) the tree's part of the last rank's path is 4 requests (done record, LIST,
node, LIST); with the commit's own checks and writes (LIST ``_claims/``, GET claim, GET manifest,
GET ``_latest/hint.json``, GET next link, PUT link, PUT ``commit.json``) the critical path is 11
requests, 13 at 8192 (one more level), as ``benchmarks.scale --realistic`` counts them. A save
costs about 2N + 2N/F requests in the tree.

Old roots keep their flat done records, ``_done/<attempt>/rank_<r>.json`` (``manifest.done_key``):
nothing writes or commits from that layout any more, but the readers (:func:`read_done_record`,
:func:`done_record_key`, :func:`count_done`) still find it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

from ckptd.errors import CheckpointError
from ckptd.manifest import DONE, MAX_RECORD_BYTES, done_key, step_dir
from storage_backends import Store

FANOUT = 64
MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Totals:
    """What a complete subtree adds up to: bytes and objects written, the sum (mod ``P``) of
    :func:`shard_hash` of every rank's shard keys, and the sum (mod 2**64) of the ranks'
    :func:`pin_digest` (None when a record of the subtree has no pins: an older writer)."""

    bytes: int
    objects: int
    digest: int
    pins: int | None = None


P = (1 << 61) - 1  # a Mersenne prime: the shard digest lives in the field Z/P
MAX_COORD = 1 << 24  # a shard coordinate's bound: far below P - 1, where g ** c repeats
PINS_VERSION = 2  # done records' pins: 1 (before issue 36) has no BLAKE3 digest per part
DIGEST_VERSION = 2  # done records say it: 1 (none) hashed no arity and took any coordinate


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@functools.lru_cache(maxsize=64)
def _base(dim: int) -> int:
    """The polynomial hash's base for coordinate ``dim``: fixed, pseudo-random, not 0 or 1."""
    return 2 + _h(f"ckptd shard digest base {dim}".encode()) % (P - 3)


@functools.lru_cache(maxsize=1 << 16)
def _path_hash(step: int, attempt: str, path: str, ndim: int) -> int:
    return 1 + _h(json.dumps([step, attempt, path, ndim]).encode()) % (P - 1)


def _split_shard_key(key: str) -> tuple[str, tuple[int, ...]] | None:
    """(array path, shard coordinate) of a shard key ``<path>/c/<i>/<j>...`` (``<path>/c`` for
    a 0-d array) spelled as its grid spells it: plain decimal coordinates below ``MAX_COORD``
    (no sign, space or leading zero: ``c/03/0`` is another object than ``c/3/0``), so the last
    ``/c/`` is the separator; None for any other key."""
    if key.endswith("/c"):
        return key[:-2], ()
    path, sep, tail = key.rpartition("/c/")
    parts = tail.split("/")
    if not sep or not path or not all(p.isascii() and p.isdigit() and p == str(int(p)) for p in parts):
        return None
    coord = tuple(map(int, parts))
    return (path, coord) if max(coord) < MAX_COORD else None


def shard_hash(key: str, step: int, attempt: str) -> int:
    """The hash of one shard key of (``step``, ``attempt``): ``H(step, attempt, path, ndim) *
    prod_d g_d ** c_d`` mod ``P`` for the shard at coordinate ``c`` of the array at ``path``.
    Equal sums mean (up to a chance of about grid size / 2**61) equal multisets; a key of
    another form hashes as a whole (never expected: it only makes sums differ)."""
    parsed = _split_shard_key(key)
    if parsed is None:
        return _h(b"other:" + key.encode()) % P
    path, coord = parsed
    h = _path_hash(step, attempt, path, len(coord))
    for d, c in enumerate(coord):
        h = h * pow(_base(d), c, P) % P
    return h


def shard_digest(keys: Iterable[str], step: int, attempt: str) -> int:
    """The sum (mod ``P``) of :func:`shard_hash` of ``keys``: the root compares what all ranks
    wrote with what the manifest needs (:func:`grid_digest`) without reading anyone's list."""
    return sum(shard_hash(k, step, attempt) for k in keys) % P


@functools.lru_cache(maxsize=1 << 12)
def _geometric(g: int, n: int) -> int:
    """1 + g + ... + g**(n-1) mod P (g != 1)."""
    return (pow(g, n, P) - 1) * pow(g - 1, P - 2, P) % P


def grid_digest(path: str, grid_shape: tuple[int, ...], step: int, attempt: str) -> int:
    """:func:`shard_digest` of every shard of a grid, in O(ndim log n) instead of O(shards):
    the sum over the grid of ``H(step, attempt, path, ndim) * prod_d g_d ** c_d`` factors into a
    product of geometric series, one per dimension."""
    h = _path_hash(step, attempt, path, len(grid_shape))
    for d, n in enumerate(grid_shape):
        h = h * _geometric(_base(d), n) % P
    return h


def pin_digest(pins: dict | None) -> int | None:
    """A 64-bit sum of hashes of every pin of a done record (None without pins): the tree sums
    it; the commit record keeps the root's sum."""
    if not isinstance(pins, dict):
        return None
    total = 0
    for kind in ("shards", "meta"):
        for key, pin in sorted((pins.get(kind) or {}).items()):
            total += _h(json.dumps([kind, key, pin], separators=(",", ":")).encode())
    return total & MASK


def make_pins(shards: dict[str, tuple], meta: dict[str, bytes]) -> dict:
    """The ``pins`` of a done record: ``shards`` maps a shard key to (object size, the
    crc32c bytes of each part as stored, concatenated: the inner chunks in storage order, then
    the index's for a sharded object, and the parts' BLAKE3 pins (``codec.part_digest``) in the
    same order, or None), ``meta`` a metadata key to its bytes. Shard pins are ``[size, base64 of
    the little-endian uint32 crcs, base64 of the digests]`` (``v`` 2; ``v`` 1, written before
    issue 36, has no digests: ``[size, crcs]``), metadata pins the sha256 hex."""
    out = {}
    for k, (size, crcs, *digests) in shards.items():
        pin = [size, base64.b64encode(crcs).decode()]
        if digests and digests[0] is not None:
            pin.append(base64.b64encode(digests[0]).decode())
        out[k] = pin
    return {
        "v": PINS_VERSION if all(len(p) == 3 for p in out.values()) else 1,
        "shards": out,
        "meta": {k: hashlib.sha256(data).hexdigest() for k, data in meta.items()},
    }


def levels(world_size: int) -> int:
    """The root's level: the smallest L >= 1 with FANOUT**L >= world_size."""
    lvl, span = 1, FANOUT
    while span < world_size:
        lvl, span = lvl + 1, span * FANOUT
    return lvl


def folder(step: int, attempt: str, level: int, index: int) -> str:
    """The folder of node (level, index)'s children."""
    return f"{step_dir(step)}/{DONE}/{attempt}/t{level}/{index:06d}/"


def _name(kind: str, index: int, t: Totals) -> str:
    pins = "" if t.pins is None else f".{t.pins:016x}"
    return f"{kind}{index:06d}.{t.bytes}.{t.objects}.{t.digest:016x}{pins}.json"


def record_totals(record: dict, step: int, attempt: str) -> Totals:
    """What a done record of (step, attempt) adds to the tree, from its contents."""
    return Totals(
        int(record.get("bytes", 0)),
        int(record.get("objects", 0)),
        shard_digest(record.get("shards", ()), step, attempt),
        pin_digest(record.get("pins")),
    )


def record_key(step: int, attempt: str, rank: int, record: dict) -> str:
    """Where rank's done record ``record`` goes (its totals are in the name)."""
    return folder(step, attempt, 1, rank // FANOUT) + _name("r", rank, record_totals(record, step, attempt))


def key_totals(key: str) -> Totals:
    """The totals a done record's key names (ValueError if none)."""
    if (parsed := _parse(key.rsplit("/", 1)[-1])) is None:
        raise ValueError(f"{key} names no totals")
    return parsed[1]


def node_key(step: int, attempt: str, level: int, index: int, t: Totals) -> str:
    return folder(step, attempt, level + 1, index // FANOUT) + _name("n", index, t)


def _parse(name: str) -> tuple[int, Totals] | None:
    """(child id, totals) from a child's name; None for anything else."""
    parts = name.split(".")
    if len(parts) not in (5, 6) or len(parts[0]) < 2 or parts[0][0] not in "rn" or parts[-1] != "json":
        return None
    try:
        ids, nbytes, objects, digest = int(parts[0][1:]), int(parts[1]), int(parts[2]), int(parts[3], 16)
        pins = int(parts[4], 16) if len(parts) == 6 else None
    except ValueError:
        return None
    if min(ids, nbytes, objects, digest) < 0 or digest > MASK or (pins is not None and not 0 <= pins <= MASK):
        return None
    return ids, Totals(nbytes, objects, digest, pins)


def sum_totals(parts: Iterable[Totals]) -> Totals:
    """The totals of a subtree from its children's (pins None if any child has none)."""
    parts = list(parts)
    pins = None if any(t.pins is None for t in parts) else sum(t.pins for t in parts) & MASK
    return Totals(
        sum(t.bytes for t in parts),
        sum(t.objects for t in parts),
        sum(t.digest for t in parts) % P,
        pins,
    )


def write_done(store: Store, step: int, attempt: str, rank: int, record: dict) -> str:
    """Write rank's done record (after all its data is durable); returns its key. ``record``
    holds at least ``bytes``, ``objects`` and ``shards`` (the shard keys this rank wrote, each
    once, spelled as their grids spell them, one arity per array: anything else is refused);
    the rest (RNG state) is for restores."""
    keys, arity = list(record.get("shards", ())), {}
    for k in keys:
        p = _split_shard_key(k)
        if p is None or arity.setdefault(p[0], len(p[1])) != len(p[1]):
            raise CheckpointError(
                f"{step_dir(step)}: rank {rank} names {k!r}, not a shard key as grids spell them "
                f"(<array>/c/<i>/<j>..., plain decimal coordinates below {MAX_COORD}, one arity per array)"
            )
    if len(set(keys)) < len(keys):
        raise CheckpointError(f"{step_dir(step)}: rank {rank} names a shard key more than once")
    key = record_key(step, attempt, rank, record)
    store.put(key, json.dumps({**record, "shard_digest": DIGEST_VERSION}, separators=(",", ":")).encode())
    return key


def record_rank(key: str, step: int, attempt: str) -> int | None:
    """The rank of the done record at ``key`` (any key listed under ``t1/``) as the tree counts
    it: the id its name carries, if it is in that rank's folder; None otherwise."""
    where, _, name = key.rpartition("/")
    parsed = _parse(name)
    ok = parsed is not None and f"{where}/" == folder(step, attempt, 1, parsed[0] // FANOUT)
    return parsed[0] if ok else None


def climb(store: Store, step: int, attempt: str, rank: int, world_size: int, commit) -> bool:
    """Carry rank's completion up the tree (after ``write_done``). ``commit(totals)``
    creates the commit record with ``put_if_absent`` and returns whether this call created it;
    it runs only when the whole tree is complete. Returns what ``commit`` returned, or False
    when the tree is not complete yet (another rank will complete it)."""
    top = levels(world_size)
    level, index = 1, rank // FANOUT
    while True:
        below = -(-world_size // FANOUT ** (level - 1))  # nodes of the level below (ranks at 0)
        lo, hi = index * FANOUT, min((index + 1) * FANOUT, below)
        where = folder(step, attempt, level, index)
        kids: dict[int, Totals] = {}
        for info in store.list(where):
            parsed = _parse(info.key[len(where) :])
            if parsed is not None and lo <= parsed[0] < hi:
                kids.setdefault(parsed[0], parsed[1])
        if len(kids) < hi - lo:
            return False
        total = sum_totals(kids.values())
        if level == top:
            return commit(total)
        node = {"bytes": total.bytes, "objects": total.objects, "digest": f"{total.digest:016x}"}
        if total.pins is not None:
            node["pins"] = f"{total.pins:016x}"
        store.put_if_absent(node_key(step, attempt, level, index, total), json.dumps(node).encode())
        level, index = level + 1, index // FANOUT


NOTICE_GROUP = 1024  # ranks polling one commit notice


def notice_keys(step: int, attempt: str, world_size: int) -> list[str]:
    """Copies of the news "committed", one per ``NOTICE_GROUP`` ranks, each in a folder (an S3
    prefix) of its own; none up to ``NOTICE_GROUP`` ranks, where polling ``commit.json`` is
    fast enough. The committer writes them right after ``commit.json`` (so a notice implies
    the commit); rank r polls ``notice_keys(...)[r // NOTICE_GROUP]``."""
    k = -(-world_size // NOTICE_GROUP)
    if k < 2:
        return []
    return [f"{step_dir(step)}/{DONE}/{attempt}/c{i:04d}/committed.json" for i in range(k)]


def count_done(store: Store, step: int, attempt: str) -> int:
    """How many ranks of ``attempt`` wrote a done record (either layout); for error messages."""
    prefix = f"{step_dir(step)}/{DONE}/{attempt}/"
    names = (info.key[len(prefix) :] for info in store.list(prefix))
    return sum(1 for n in names if n.startswith("rank_") or (n.startswith("t1/") and "/r" in n))


def attempts(store: Store, step: int) -> set[str]:
    """The attempts that wrote anything under the step's done records (either layout): one LIST
    of ``<step>/_done/``. The daemon refuses to resume a journalled job once another attempt of
    its step has started."""
    prefix = f"{step_dir(step)}/{DONE}/"
    return {o.key[len(prefix) :].split("/", 1)[0] for o in store.list(prefix)}


def reported_ranks(store: Store, step: int, attempt: str) -> set[int]:
    """The ranks of ``attempt`` that wrote a done record (either layout): one listing. The
    status page names the others when a step waits too long (a dead node's ranks)."""
    prefix = f"{step_dir(step)}/{DONE}/{attempt}/"
    out = set()
    for info in store.list(prefix):
        name = info.key[len(prefix) :]
        if name.startswith("rank_") and name.endswith(".json"):
            with contextlib.suppress(ValueError):
                out.add(int(name[len("rank_") : -len(".json")]))
        elif name.startswith("t1/"):
            parsed = _parse(name.rsplit("/", 1)[-1])
            if parsed is not None and name.rsplit("/", 1)[-1].startswith("r"):
                out.add(parsed[0])
    return out


def done_record_key(store: Store, step: int, attempt: str, rank: int) -> str:
    """The key of rank's done record: found in the tree (one LIST of its name's prefix), else
    the flat key of checkpoints older than the tree (which may not exist either)."""
    for info in store.list(f"{folder(step, attempt, 1, rank // FANOUT)}r{rank:06d}."):
        return info.key
    return done_key(step, attempt, rank)


def read_done_record(store: Store, step: int, attempt: str, rank: int) -> dict:
    """Rank's done record in either layout. Raises NotFoundError, or ValueError if malformed."""
    return _load(store, done_record_key(store, step, attempt, rank))


def _load(store: Store, key: str) -> dict:
    """A done record, capped at MAX_RECORD_BYTES (StorageError if larger); deep JSON is a
    ValueError like any other malformed record."""
    try:
        return json.loads(store.get(key, limit=MAX_RECORD_BYTES))
    except RecursionError:
        raise ValueError(f"done record {key} is nested too deep") from None


__all__ = [
    "FANOUT",
    "NOTICE_GROUP",
    "P",
    "Totals",
    "attempts",
    "climb",
    "count_done",
    "done_record_key",
    "grid_digest",
    "key_totals",
    "levels",
    "make_pins",
    "notice_keys",
    "pin_digest",
    "read_done_record",
    "record_key",
    "record_rank",
    "record_totals",
    "shard_digest",
    "shard_hash",
    "sum_totals",
    "write_done",
]
