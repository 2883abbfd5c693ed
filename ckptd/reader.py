"""Read sub-boxes of a checkpoint's arrays, checking every chunk's crc32c (or, where its writer
pinned one, its BLAKE3).

A read computes where each touched inner chunk sits in its shard object (our encoder stores them
back to back in C order; the shard index is read only if a chunk fails its check), coalesces
chunks that are adjacent in the object into one ranged read, and scatters it: whole chunks land
straight in the caller's preallocated array, edge chunks in scratch buffers whose wanted part is
copied. Inline scalars are read from the manifest. Bytes read per bytes wanted stays near 1
whenever inner chunks are small against the wanted box.

Thread safety: a ``CheckpointReader`` may be used from many threads; it holds no mutable state
except a statistics counter guarded by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from ckptd.codec import (
    CRC_BYTES,
    DIGEST_BYTES,
    EMPTY,
    ArrayLayout,
    check_chunk,
    crc_bytes,
    decode_chunk,
    decode_index,
    parse_inline,
    part_digest,
)
from ckptd.errors import CheckpointError, CorruptChunkError
from ckptd.layout import Box, ShardRead, chunk_box, plan_reads
from ckptd.manifest import TensorEntry
from ckptd.pins import Pins, shard_pin
from storage_backends import NotFoundError, StorageError, Store

__all__ = ["COALESCE_GAP", "CheckpointReader", "ReadRequest", "ReadStats", "run_all"]

# Chunks closer than this in the object are fetched by one GET (the gap is read and dropped).
COALESCE_GAP = 64 * 1024


@dataclass
class ReadStats:
    bytes_read: int = 0
    requests: int = 0


@dataclass(frozen=True)
class ReadRequest:
    entry: TensorEntry
    want: Box
    out: np.ndarray  # shape == want.shape, dtype == the array's


class CheckpointReader:
    """Reads arrays of one checkpoint folder (``prefix``, e.g. ``step_0000000100/``)."""

    def __init__(self, store: Store, prefix: str, where: str | None = None, pins: Pins | None = None):
        """``pins``: the pins of the committing attempt's done records that cover the shards
        to read (``ckptd.pins``): every chunk's stored crc32c (and a shard index's) must then
        equal the one its writer pinned, and its bytes as read hash to the BLAKE3 its writer
        pinned (done records since issue 36; that check replaces the chunk's crc32c
        recomputation), else ``CorruptChunkError`` naming the object. None:
        each chunk is checked against its own crc32c only (a step committed before pins)."""
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"
        self.where = where or f"{store.uri.rstrip('/')}/{self.prefix.rstrip('/')}"
        self.stats = ReadStats()
        self.pins = pins
        self._lock = threading.Lock()

    def _part(self, entry: TensorEntry, off: int | None, crcs: bytes) -> int:
        """Which part sits at offset ``off`` (None: the shard index): parts are back to back, so
        that is part ``off // (chunk bytes + 4)``, the index last."""
        return len(crcs) // CRC_BYTES - 1 if off is None else off // (entry.layout.chunk_nbytes + CRC_BYTES)

    def _check_pinned(self, entry: TensorEntry, shard: Sequence[int], off: int | None, crc) -> None:
        """The crc32c stored after the part at offset ``off`` (None: the shard index) against its pin."""
        if self.pins is None:
            return
        rel = f"{entry.path}/{entry.layout.shard_key(shard)}"
        _, crcs, _ = shard_pin(self.pins, rel, self._name(entry, shard))
        k = self._part(entry, off, crcs)
        if bytes(crc) != crcs[k * CRC_BYTES : (k + 1) * CRC_BYTES]:
            raise CorruptChunkError(
                f"{self._name(entry, shard)}: object {self.prefix}{rel} differs from what its committing attempt "
                "wrote (a crc32c pinned in its done record differs: replaced after the commit)"
            )

    def _vouched(self, entry: TensorEntry, shard: Sequence[int], off: int | None, parts: tuple, check) -> bool:
        """The part at offset ``off`` (None: the index), as read (``parts``: its buffers, its
        crc32c last), against its BLAKE3 pin (issue 36). True when checked: the digest stands
        for the crc32c then (it catches corruption as well), so the caller need not recompute
        that. False when there is no such pin (no pins, or a done record written before them).
        On a mismatch ``check()`` raises first what the part's own checks say of it (a corrupt
        chunk still reads as one); a part that passes them was forged: CorruptChunkError."""
        if self.pins is None:
            return False
        rel = f"{entry.path}/{entry.layout.shard_key(shard)}"
        _, crcs, digests = shard_pin(self.pins, rel, self._name(entry, shard))
        if not digests:
            return False
        k = self._part(entry, off, crcs)
        if part_digest(*parts) == digests[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]:
            return True
        check()
        raise CorruptChunkError(
            f"{self._name(entry, shard)}: object {self.prefix}{rel} differs from what its committing attempt "
            "wrote (its BLAKE3 pinned in its done record differs: replaced after the commit)"
        )

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.requests += 1

    def _name(self, entry: TensorEntry, shard: Sequence[int], chunk: Sequence[int] | None = None) -> str:
        s = f"{self.where}: array {entry.path!r} shard {entry.layout.shard_key(shard)}"
        return s if chunk is None else f"{s} chunk {tuple(chunk)}"

    def _object(self, entry: TensorEntry, shard: Sequence[int]) -> str:
        return f"{self.prefix}{entry.path}/{entry.layout.shard_key(shard)}"

    def shard_index(self, entry: TensorEntry, shard: Sequence[int]) -> np.ndarray:
        layout = entry.layout
        try:
            data = self.store.get_range(self._object(entry, shard), -layout.index_nbytes, layout.index_nbytes)
        except NotFoundError:
            raise CorruptChunkError(f"{self._name(entry, shard)}: shard object is missing") from None
        except StorageError as e:
            raise CorruptChunkError(f"{self._name(entry, shard)}: cannot read shard index ({e})") from None
        self._count(len(data))
        index = decode_index(layout, data, self._name(entry, shard))
        self._check_pinned(entry, shard, None, data[-CRC_BYTES:])
        self._vouched(entry, shard, None, (data,), lambda: None)
        return index

    def read_shard(self, req: ReadRequest, sr: ShardRead) -> None:
        """Fill the part of ``req.out`` that shard ``sr.shard`` holds.

        The fast path reads the chunks at the offsets the layout implies, without the shard index
        (a seek saved per shard on a disk, a request on S3); a chunk failing its crc32c there (a
        short or corrupt shard) retries the read from the index. A shard whose equal sized chunks
        another writer permuted passes every crc on the fast path: that is why committed
        checkpoints are immutable, and ``ckptd verify`` checks the order."""
        entry, layout = req.entry, req.entry.layout
        try:
            self._read_spans(req, sr.shard, self._computed_spans(layout, sr))
            return
        except CorruptChunkError:
            if not layout.sharded:  # a plain chunk has no index to fall back to
                raise
        index = self.shard_index(entry, sr.shard)
        spans = []
        for c in sr.chunks:
            off, n = (int(x) for x in index[c])
            if off == EMPTY and n == EMPTY:
                raise CorruptChunkError(f"{self._name(entry, sr.shard, c)}: chunk is absent from the shard")
            if n != layout.chunk_nbytes + CRC_BYTES:  # read no more than a chunk: the index is data
                raise CorruptChunkError(f"{self._name(entry, sr.shard, c)}: index entry ({off}, {n}) is out of bounds")
            spans.append((off, n, c))
        self._read_spans(req, sr.shard, spans)

    @staticmethod
    def _computed_spans(layout: ArrayLayout, sr: ShardRead) -> list[tuple[int, int, tuple]]:
        """Where ``encode_shard`` put each chunk: chunks wholly outside the array are absent,
        the present ones form a box [0, present) of the chunk grid, stored in C order."""
        start, stop = layout.shard_box(sr.shard)
        present = tuple(-(-(b - a) // c) for a, b, c in zip(start, stop, layout.chunk_shape, strict=True))
        n = layout.chunk_nbytes + CRC_BYTES
        return [(int(np.ravel_multi_index(c, present)) * n if present else 0, n, c) for c in sr.chunks]

    def _read_spans(self, req: ReadRequest, shard, spans: list[tuple[int, int, tuple]]) -> None:
        entry = req.entry
        key = self._object(entry, shard)
        spans = sorted(spans)
        groups: list[list[tuple[int, int, tuple]]] = []
        for span in spans:
            if groups and span[0] - (groups[-1][-1][0] + groups[-1][-1][1]) <= COALESCE_GAP:
                groups[-1].append(span)
            else:
                groups.append([span])
        try:
            # spans a shard index gave that the scatter read refuses go the checked path
            malformed = [g for g in groups if not self._read_scatter(req, shard, key, g, g[0][0])]
            if malformed:
                ranges = [(g[0][0], g[-1][0] + g[-1][1] - g[0][0]) for g in malformed]
                for g, blob in zip(malformed, self.store.get_ranges(key, ranges), strict=True):
                    self._count(len(blob))
                    self._copy_chunks(req, shard, g, g[0][0], blob)
        except NotFoundError:
            raise CorruptChunkError(f"{self._name(entry, shard)}: shard object is missing") from None
        except StorageError as e:
            raise CorruptChunkError(f"{self._name(entry, shard)}: read failed ({e})") from None

    def _copy_chunks(self, req: ReadRequest, shard, group, start: int, blob) -> None:
        """Check each chunk of a fetched range and copy its wanted part into ``req.out``."""
        layout = req.entry.layout
        mv = memoryview(blob)
        for off, n, c in group:
            part = mv[off - start : off - start + n]
            name = self._name(req.entry, shard, c)
            vouched = self._vouched(req.entry, shard, off, (part,), partial(check_chunk, layout, part, name))
            chunk = decode_chunk(layout, part, name, crc=not vouched)
            self._check_pinned(req.entry, shard, off, part[-CRC_BYTES:])
            _place(req, chunk, chunk_box(layout, shard, c))

    def _read_scatter(self, req: ReadRequest, shard, key: str, group, start: int) -> bool:
        """One scatter read (``preadv`` on a filesystem) per coalesced range: a chunk wanted whole
        on a contiguous stretch of ``req.out`` is read straight into it, the others (at the box's
        or the array's edges) into scratch buffers copied from after the crc32c check. False when
        the spans are malformed, for the checked path to report."""
        layout = req.entry.layout
        n_chunk = layout.chunk_nbytes + CRC_BYTES
        views: list[memoryview] = []
        direct, staged = [], []
        pos = start
        for off, n, c in group:
            if n != n_chunk or off < pos:
                return False
            if off > pos:
                views.append(memoryview(np.empty(off - pos, np.uint8)))  # a gap between chunks: dropped
            cbox = chunk_box(layout, shard, c)
            dst = None
            if cbox.shape == layout.chunk_shape and cbox.intersect(req.want) == cbox:
                where = cbox.relative_to(req.want)
                dst = req.out[where] if where else req.out  # out[()] of a 0-d array is a copy, not a view
                if not dst.flags.c_contiguous:
                    dst = None
            if dst is not None:
                body = memoryview(dst.reshape(-1).view(np.uint8))
                crc = memoryview(bytearray(CRC_BYTES))
                views += [body, crc]
                direct.append((body, crc, c, off))
            else:
                scratch = memoryview(np.empty(n_chunk, np.uint8))
                views.append(scratch)
                staged.append((scratch, c, off))
            pos = off + n
        self.store.get_range_into(key, start, views)
        self._count(pos - start)
        for body, crc, c, off in direct:

            def check(body=body, crc=crc, c=c) -> None:
                if crc_bytes(body) != crc:  # the little-endian crc32c the chunk was stored with
                    raise CorruptChunkError(f"{self._name(req.entry, shard, c)}: crc32c mismatch (corrupt chunk)")

            if not self._vouched(req.entry, shard, off, (body, crc), check):
                check()
            self._check_pinned(req.entry, shard, off, crc)
        for scratch, c, off in staged:
            self._copy_chunks(req, shard, [(off, n_chunk, c)], off, scratch)
        return True

    def read(self, requests: Iterable[ReadRequest], pool: ThreadPoolExecutor | None = None) -> None:
        """Fill every request's ``out``; shards are fetched in parallel on ``pool`` if given."""
        tasks = self.plan(requests)
        if pool is not None:  # largest first: a big shard read last would run alone while the pool idles
            tasks.sort(key=lambda t: -len(t[1].chunks) * t[0].entry.layout.chunk_nbytes)
        run_all(pool, [(self.read_shard, t) for t in tasks])

    @staticmethod
    def plan(requests: Iterable[ReadRequest]) -> list:
        """(request, shard read) for every shard the requests need; inline scalars are filled here."""
        tasks = []
        for req in requests:
            if req.out.shape != req.want.shape:
                raise CheckpointError(f"{req.entry.key}: output shape {req.out.shape} != wanted {req.want.shape}")
            if req.entry.value is not None:  # an inline scalar: no chunk object to read
                req.out[...] = parse_inline(req.entry.value)
                continue
            tasks.extend((req, sr) for sr in plan_reads(req.entry.layout, req.want))
        return tasks


def run_all(pool: ThreadPoolExecutor | None, jobs: list) -> None:
    """Run every ``(fn, args)`` of ``jobs``, on ``pool`` when given (else in order); once all have
    run, raise the first CheckpointError any raised."""
    if pool is None:
        for fn, args in jobs:
            fn(*args)
        return
    futures = [pool.submit(fn, *args) for fn, args in jobs]
    errors = []
    for f in futures:
        try:
            f.result()
        except CheckpointError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _place(req: ReadRequest, chunk: np.ndarray, cbox: Box) -> None:
    """Copy the part of a decoded chunk (global box ``cbox``) that ``req`` wants into its output."""
    inter = cbox.intersect(req.want)
    if inter is not None:
        src = chunk[tuple(slice(a - o, b - o) for a, b, o in zip(inter.start, inter.stop, cbox.start, strict=True))]
        req.out[inter.relative_to(req.want)] = src
