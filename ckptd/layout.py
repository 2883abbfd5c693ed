"""Write and read planning for one array: which rank writes which shard (and its inner chunk
shape), and which chunks a reader of a box needs. ``ckptd.reshard`` builds on it for whole
target layouts of a job.

Nothing here touches torch.distributed or storage; inputs are global shapes and boxes, outputs
are frozen dataclasses. Every rank runs the same functions on the same inputs and gets the same
plan, so no plan is ever gathered or broadcast.

Save: the saving blocks of a tensor (one per rank, from its DTensor placements) usually tile a
regular grid (FSDP's ``torch.chunk`` split, even TP, their even 2-D products): the zarr shard
grid is then that grid and each rank writes its own block as one shard object. Replicated blocks
(DDP, an unsharded bias) are written by one replica, picked by a hash of the key so the writes
spread over ranks; a large fully replicated tensor is split along dim 0 so every rank writes a
part. Blocks that tile no regular grid (2-D FSDP x TP on an uneven dimension: 50257 rows over
TP=2 x FSDP=2 gives 12565/12564/12564/12564) get the even grid ``ceil(n / blocks)`` and a list of
boundary-row *transfers* between neighbours, so every shard still has exactly one writer that
holds all of its rows before it writes.

Restore: a reader intersects the box it needs with the shard grid and the inner-chunk grid;
cost is O(chunks touched), never O(saving ranks).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptd.codec import ArrayLayout

__all__ = [
    "Box",
    "CHUNKS_PER_SHARD",
    "GATHER_SMALL_BYTES",
    "Grid",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "SMALL_SHARD_BYTES",
    "SPLIT_REPLICATED_BYTES",
    "ShardRead",
    "Transfer",
    "WritePlan",
    "choose_chunk_shape",
    "chunk_box",
    "interval_grid",
    "plan_grid",
    "plan_reads",
    "plan_writes",
    "read_cost",
    "shard_index",
    "stable_hash",
]

MiB = 1 << 20
KiB = 1 << 10
# Inner chunks. A reader at another world size fetches whole chunks, so at each boundary of its
# box it reads up to one chunk it does not need: chunks of ~1/32 of the shard keep bytes read /
# bytes restored near 1.03 even when the new boxes are about the size of the old shards, while
# reads of adjacent chunks still coalesce into one ranged GET per shard.
SMALL_SHARD_BYTES = 1 * MiB  # shards up to this size are one chunk
CHUNKS_PER_SHARD = 32
MAX_CHUNK_BYTES = 4 * MiB
MIN_CHUNK_BYTES = 64 * KiB
# A fully replicated tensor at least this large is split along dim 0 so that every replica
# writes a part (DDP saves then use every rank's disk/network bandwidth).
SPLIT_REPLICATED_BYTES = 8 * MiB
# A sharded tensor at most this large (biases, norms and their optimizer state) is one shard,
# written by one rank that receives the other ranks' blocks during the snapshot: otherwise an
# N-way FSDP save writes N objects of a few bytes per such tensor (4096 per bias at 4096 ranks),
# and every reader opens all of them.
GATHER_SMALL_BYTES = 256 * KiB


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle [start, stop) of a tensor in global coordinates."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def from_offset(cls, offset: Sequence[int], shape: Sequence[int]) -> Box:
        return cls(tuple(offset), tuple(o + s for o, s in zip(offset, shape, strict=True)))

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in zip(self.start, self.stop, strict=True))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.volume == 0

    def intersect(self, other: Box) -> Box | None:
        start = tuple(max(a, b) for a, b in zip(self.start, other.start, strict=True))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        box = Box(start, stop)
        return None if box.empty else box

    def contains_point(self, p: Sequence[int]) -> bool:
        return all(a <= x < b for a, x, b in zip(self.start, p, self.stop, strict=True))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices that select this box inside an array holding ``outer``."""
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, outer.start, strict=True))


def stable_hash(key: str) -> int:
    return zlib.crc32(key.encode())


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending, in O(sqrt n)."""
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in reversed(small) if i * i != n]


def choose_chunk_shape(
    shard_shape: Sequence[int],
    itemsize: int,
    target: int | None = None,
    floor: int = MIN_CHUNK_BYTES,
) -> tuple[int, ...]:
    """Inner chunk shape for a shard: about 1/32 of it (64 KiB..4 MiB, or ``target``), dividing
    the shard exactly (tensorstore needs the shard shape to be a multiple of the chunk shape),
    whole rows wherever a row fits in 4 MiB, so that a chunk is a contiguous byte range of the
    shard's C-order buffer (written and read in place, no copy).

    Among the divisors of the leading extent we take the largest whose chunk stays <= target;
    if that is below ``floor`` (a prime extent has only 1 and itself) the smallest >= floor.
    """
    shard_shape = tuple(shard_shape)
    total = math.prod(shard_shape) * itemsize
    if not shard_shape or total <= SMALL_SHARD_BYTES:
        return shard_shape
    if target is None:
        target = min(MAX_CHUNK_BYTES, max(floor, total // CHUNKS_PER_SHARD))
    chunk = list(shard_shape)
    for d, n in enumerate(shard_shape):
        row = math.prod(shard_shape[d + 1 :]) * itemsize
        if row > MAX_CHUNK_BYTES:
            chunk[d] = 1
            continue  # one slice along d is still too big: split the next dimension too
        divs = _divisors(n)
        best = next((k for k in reversed(divs) if k * row <= target), 1)
        if best * row < floor:
            best = next((k for k in divs if k * row >= floor), n)
        chunk[d] = best
        break
    return tuple(chunk)


@dataclass(frozen=True, slots=True)
class Transfer:
    """Rows ``box`` (global coordinates) travel from rank ``src`` to rank ``dst`` before the save,
    because ``dst`` writes the shard that holds them."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class WritePlan:
    """The zarr layout of one tensor and who writes each of its shards."""

    layout: ArrayLayout
    writers: dict[tuple[int, ...], int]  # shard coordinate -> rank
    transfers: tuple[Transfer, ...] = ()

    @property
    def regular(self) -> bool:
        return not self.transfers


def interval_grid(intervals: set[tuple[int, int]], extent: int) -> int | None:
    """The step ``s`` if the non-empty intervals are exactly the cells of the grid with step s
    covering [0, extent), else None."""
    if not intervals:
        return None
    s = max(b - a for a, b in intervals)
    cells = {(k * s, min(k * s + s, extent)) for k in range(-(-extent // s))}
    return s if intervals == cells else None


def shard_index(layout: ArrayLayout, coord: Sequence[int]) -> int:
    """A shard's index in C order over the layout's shard grid."""
    idx = 0
    for c, g in zip(coord, layout.grid_shape, strict=True):
        idx = idx * g + c
    return idx


@dataclass(frozen=True)
class Grid:
    """The key-independent part of a write plan: the zarr layout and, per shard, the ranks that
    hold all of it (the replicas of its owning block). Computed once per distinct (shape, dtype,
    sharding) -- O(ranks) -- and shared by every tensor of that signature; picking the writers of
    one key from it is O(1) per rank (:meth:`shards_of`), so a save never costs O(ranks x tensors).
    """

    layout: ArrayLayout
    coords: tuple[tuple[int, ...], ...]  # shard coordinates
    candidates: tuple[tuple[int, ...], ...]  # per shard: ranks that hold all of its owning block
    split: bool = False  # a fully replicated tensor split along dim 0: shard i -> ranks[(h + i) % n]
    # Irregular grids only: per shard, (candidate ranks, box) of every piece its writer lacks.
    # Gathered grids (one shard, any rank may write it): every distinct block, with its replicas;
    # the writer receives those it does not hold.
    pieces: tuple[tuple[tuple[tuple[int, ...], Box], ...], ...] = ()
    gather: bool = False
    _mine: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _block_of: dict[int, int] = field(default_factory=dict, repr=False, compare=False)  # gather: rank -> piece
    _runs: dict = field(default_factory=dict, repr=False, compare=False)  # writer_runs of a key-free plan

    def __post_init__(self):
        mine: dict[int, list[int]] = {}
        if not self.split:
            for i, ranks in enumerate(self.candidates):
                for r in ranks:
                    mine.setdefault(r, []).append(i)
        self._mine.update({r: tuple(v) for r, v in mine.items()})
        if self.gather:
            self._block_of.update({r: i for i, (ranks, _) in enumerate(self.pieces[0]) for r in ranks})

    @property
    def regular(self) -> bool:
        return not any(self.pieces)

    def writer(self, key: str, i: int) -> int:
        ranks = self.candidates[i]
        return ranks[(stable_hash(key) + (i if self.split else 0)) % len(ranks)]

    def shards_of(self, key: str, rank: int) -> list[tuple[int, ...]]:
        """The shards ``rank`` writes for tensor ``key``."""
        if self.split:
            ranks = self.candidates[0]
            if rank not in ranks:
                return []
            i = (ranks.index(rank) - stable_hash(key)) % len(ranks)
            return [self.coords[i]] if i < len(self.coords) else []
        return [self.coords[i] for i in self._mine.get(rank, ()) if self.writer(key, i) == rank]

    def writer_runs(self, key: str) -> tuple[tuple[int, int, int], ...]:
        """Which rank writes each shard of tensor ``key``, compactly, for the manifest (a restore
        reads the done records of those ranks only, ``ckptd.pins``): runs ``(first, rank,
        count)`` meaning shards ``first .. first + count - 1`` (C order over the shard grid) are
        written by ranks ``rank .. rank + count - 1``. One run for an FSDP grid, two for a split
        replicated tensor. Key-independent plans are computed once per grid; a split over a
        contiguous range of ranks in O(1); anything else in O(shards) once per key and job."""
        if self.split and self.candidates:
            ranks = self.candidates[0]
            n, count = len(ranks), len(self.coords)
            if ranks == tuple(range(ranks[0], ranks[0] + n)):
                h = stable_hash(key) % n  # shard i -> ranks[(h + i) % n]
                head = min(count, n - h)
                runs = [(0, ranks[0] + h, head)]
                if count > head:
                    runs.append((head, ranks[0], count - head))
                return tuple(runs)
        if all(len(c) == 1 for c in self.candidates):
            runs = self._runs.get(None)
            if runs is None:
                runs = self._runs[None] = self._compute_runs(key)
            return runs
        return self._compute_runs(key)

    def _compute_runs(self, key: str) -> tuple[tuple[int, int, int], ...]:
        pairs = sorted((shard_index(self.layout, c), self.writer(key, i)) for i, c in enumerate(self.coords))
        runs: list[list[int]] = []
        for idx, rank in pairs:
            if runs and idx == runs[-1][0] + runs[-1][2] and rank == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([idx, rank, 1])
        return tuple(tuple(r) for r in runs)

    def meta_writer(self, key: str) -> int:
        """The rank that writes the array's zarr.json: the writer of its first shard."""
        return self.writer(key, 0) if self.coords else 0

    def transfers(self, key: str) -> list[Transfer]:
        """Every transfer of tensor ``key``, in an order all ranks agree on. O(ranks) for a
        gathered grid: for tools and tests; a save uses :meth:`transfers_of`."""
        out = []
        for i, pieces in enumerate(self.pieces):
            dst = self.writer(key, i)
            out += [
                Transfer(ranks[stable_hash(key) % len(ranks)], dst, box)
                for ranks, box in pieces
                if not (self.gather and dst in ranks)
            ]
        return out

    def transfers_of(self, key: str, rank: int) -> list[tuple[int, Transfer]]:
        """The transfers of ``key`` that ``rank`` sends or receives, each with its index in
        :meth:`transfers` (both ends derive the same message tag from it). For a gathered grid
        this is O(1) on a sender and O(distinct blocks) on the one writer, so a save of many
        small tensors at many ranks never costs O(ranks x tensors) on any rank."""
        if not self.gather:
            return [(j, t) for j, t in enumerate(self.transfers(key)) if rank in (t.src, t.dst)]
        dst = self.writer(key, 0)
        if rank == dst:
            return list(enumerate(self.transfers(key)))
        i = self._block_of.get(rank)
        if i is None:
            return []
        ranks, box = self.pieces[0][i]
        if dst in ranks or ranks[stable_hash(key) % len(ranks)] != rank:
            return []  # the writer holds this block itself, or another replica sends it
        # its index among the pieces the writer receives: the pieces before it, less the writer's
        j = i - (1 if self._block_of.get(dst, len(self.pieces[0])) < i else 0)
        return [(j, Transfer(rank, dst, box))]


def plan_grid(
    shape: Sequence[int],
    itemsize: int,
    dtype: str,
    blocks: Sequence[Box],
    *,
    target_chunk: int | None = None,
    min_chunk: int = MIN_CHUNK_BYTES,
    split_replicated: int = SPLIT_REPLICATED_BYTES,
    gather_small: int = GATHER_SMALL_BYTES,
) -> Grid:
    """The grid of a tensor whose rank ``r`` holds ``blocks[r]`` (its DTensor local block; the
    full box for a replicated tensor). Deterministic in its inputs."""
    shape = tuple(shape)
    ndim = len(shape)
    if math.prod(shape) == 0:  # empty tensor: metadata only
        return Grid(ArrayLayout.empty(shape, dtype), (), ())

    replicas: dict[Box, list[int]] = {}
    for rank, b in enumerate(blocks):
        if not b.empty:
            replicas.setdefault(b, []).append(rank)
    if not replicas:
        raise ValueError(f"no rank holds any data of this tensor of shape {shape}")

    def mk(shard_shape: tuple[int, ...]) -> ArrayLayout:
        return ArrayLayout(
            shape, dtype, shard_shape, choose_chunk_shape(shard_shape, itemsize, target_chunk, min_chunk)
        )

    full = Box.full(shape)
    if list(replicas) == [full]:
        ranks = tuple(replicas[full])
        nbytes = math.prod(shape) * itemsize
        if ndim and len(ranks) > 1 and nbytes >= split_replicated and shape[0] > 1:
            s0 = -(-shape[0] // min(len(ranks), shape[0]))
            layout = mk((s0, *shape[1:]))
            coords = tuple(layout.shard_coords())
            return Grid(layout, coords, tuple(ranks for _ in coords), split=True)
        return Grid(mk(shape), (tuple([0] * ndim),), (ranks,))

    if math.prod(shape) * itemsize <= gather_small and len(replicas) > 1:
        boxes = sorted(replicas, key=lambda b: b.start)
        holders = tuple(sorted(r for b in boxes for r in replicas[b]))
        pieces = tuple((tuple(replicas[b]), b) for b in boxes)
        return Grid(mk(shape), (tuple([0] * ndim),), (holders,), pieces=(pieces,), gather=True)

    ivs = [{(b.start[d], b.stop[d]) for b in replicas} for d in range(ndim)]
    steps = [interval_grid(iv, n) for iv, n in zip(ivs, shape, strict=True)]
    regular = all(s is not None for s in steps) and len(replicas) == math.prod(
        -(-n // s) for n, s in zip(shape, steps, strict=True)
    )
    if regular:
        shard_shape = tuple(steps)
        items = sorted(
            (tuple(b.start[d] // shard_shape[d] for d in range(ndim)), tuple(r)) for b, r in replicas.items()
        )
        return Grid(mk(shard_shape), tuple(c for c, _ in items), tuple(r for _, r in items))

    # Irregular: an even grid over each dimension, and transfers of the rows that a shard's
    # writer lacks from the ranks that hold them.
    layout = mk(tuple(s if s is not None else -(-n // len(iv)) for s, n, iv in zip(steps, shape, ivs, strict=True)))
    boxes = sorted(replicas, key=lambda b: b.start)
    coords, candidates, pieces = [], [], []
    for coord in layout.shard_coords():
        cell = Box(*layout.shard_box(coord))
        owner = next((b for b in boxes if b.contains_point(cell.start)), None)
        parts = [(b, p) for b in boxes if (p := b.intersect(cell)) is not None]
        if owner is None or sum(p.volume for _, p in parts) != cell.volume:
            raise ValueError(f"saving blocks do not tile the tensor of shape {shape}")
        coords.append(coord)
        candidates.append(tuple(replicas[owner]))
        pieces.append(tuple((tuple(replicas[b]), p) for b, p in parts if b != owner))
    return Grid(layout, tuple(coords), tuple(candidates), pieces=tuple(pieces))


def plan_writes(key: str, shape: Sequence[int], itemsize: int, dtype: str, blocks: Sequence[Box], **kw) -> WritePlan:
    """The whole plan of one tensor (every shard's writer): for tools and tests. A save uses
    :func:`plan_grid` once per signature and :meth:`Grid.shards_of` per key instead."""
    grid = plan_grid(shape, itemsize, dtype, blocks, **kw)
    writers = {c: grid.writer(key, i) for i, c in enumerate(grid.coords)}
    return WritePlan(grid.layout, writers, tuple(grid.transfers(key)))


@dataclass(frozen=True, slots=True)
class ShardRead:
    """The inner chunks of one shard that intersect a wanted box."""

    shard: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]  # coordinates inside the shard's chunk grid


def _range(lo: int, hi: int, step: int) -> range:
    return range(lo // step, -(-hi // step))


def plan_reads(layout: ArrayLayout, want: Box) -> list[ShardRead]:
    """Shards and inner chunks to fetch to fill ``want``. O(chunks touched)."""
    if want.empty:
        return []
    out = []
    shard_ranges = [_range(a, b, s) for a, b, s in zip(want.start, want.stop, layout.shard_shape, strict=True)]
    for shard in itertools.product(*shard_ranges):  # of nothing: one empty tuple (a 0-d array)
        s_start, s_stop = layout.shard_box(shard)
        local = Box(s_start, s_stop).intersect(want)
        if local is None:
            continue
        chunk_ranges = [
            _range(a - o, b - o, c)
            for a, b, o, c in zip(local.start, local.stop, s_start, layout.chunk_shape, strict=True)
        ]
        out.append(ShardRead(shard, tuple(itertools.product(*chunk_ranges))))
    return out


def chunk_box(layout: ArrayLayout, shard: Sequence[int], chunk: Sequence[int]) -> Box:
    """Global box of an inner chunk, clipped to the array."""
    start = tuple(
        s * ss + c * cs for s, ss, c, cs in zip(shard, layout.shard_shape, chunk, layout.chunk_shape, strict=True)
    )
    stop = tuple(min(a + cs, n) for a, cs, n in zip(start, layout.chunk_shape, layout.shape, strict=True))
    return Box(start, stop)


def read_cost(layout: ArrayLayout, want: Box) -> tuple[int, int]:
    """(bytes fetched, objects touched) to fill ``want``: what ``ckptd reshard`` reports."""
    reads = plan_reads(layout, want)
    return sum(len(sr.chunks) for sr in reads) * (layout.chunk_nbytes + 4), len(reads)
