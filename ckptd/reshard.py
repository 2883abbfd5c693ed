"""Target layouts: the layout a job of M ranks will restore with (``ckptd reshard --layout``),
whether it can work, what each rank reads, and the array layouts a rechunk writes for it. Where
the data position resumes is ``ckptd.sampler_math``; the per-array write and read planning this
builds on is ``ckptd.layout``.

Nothing here touches storage or torch.distributed; inputs are a manifest's tensor table (global
shapes, saved layouts) and a :class:`TargetLayout`, outputs are frozen dataclasses. The plan is
O(M x tensors) in all and O(tensors) per rank; a rank's read of a tensor costs O(chunks touched)
(:func:`ckptd.layout.read_cost`), never O(saving ranks).

Target layouts (``--layout``), for a job of M ranks:

``fsdp`` (default)
    FSDP2 ``fully_shard`` on a 1-D mesh: dim 0 of every sharded tensor splits like
    ``torch.chunk`` -- ``ceil(n / M)`` rows per rank, so the last ranks may get fewer rows or
    none (FSDP2 allows uneven and empty blocks, so this layout works for every tensor).
``ddp`` or ``replicated``
    Every rank holds, and reads, every tensor whole.
``tp=T[,dp=D]`` (also ``dp=D``)
    A 2-D mesh ``(dp, tp)`` with TP innermost, as torchtitan builds it: rank ``r`` has
    ``dp index = r // T`` and ``tp index = r % T``. D defaults to ``M / T``; ``T * D`` must be M.
    Convention (a column-parallel model): a sharded tensor of two or more dimensions splits
    dim 0 over TP first (``ColwiseParallel``, ``Shard(0)``), then FSDP2 splits that TP block's
    dim 0 again over DP, so rank ``(d, t)`` holds the ``d``-th ``torch.chunk`` of the ``t``-th
    ``torch.chunk``. A sharded 1-D tensor (a norm weight, a bias) is replicated over TP and split
    over DP only. Row-parallel weights (``Shard(1)``) are not modelled: the byte counts are
    then an estimate, the restore itself still reads exactly what each rank owns.

Which tensors a layout shards: those the checkpoint saved sharded (their placements name a
shard: ``S(0)``, ``_S(0, 2)``). A tensor saved replicated (a buffer, a DDP parameter, a 0-d step
counter) is read whole by every rank. When nothing was saved sharded (one process, DDP) the
planner cannot tell parameters from buffers and shards every tensor of one or more dimensions.

What *cannot work* (:class:`LayoutError`, ``ckptd reshard`` exits 1):

* M < 1;
* ``tp=T`` where T does not divide M, or ``tp=T,dp=D`` with ``T * D != M``;
* under ``tp`` x ``dp`` (both > 1), a tensor whose dim 0 splits so unevenly that the blocks
  FSDP2 holds (the nested ``torch.chunk`` above) are not the blocks torch's ``_StridedShard``
  metadata describes for the DTensor. The restore refuses such a DTensor ("local shape differs
  from the computed block"), and so would a save. Example: 13 rows over ``tp=2,dp=3`` (the TP
  blocks are 7 and 6 rows; FSDP2 splits them 3/3/1 and 2/2/2, torch's metadata says 3/2, 3/2,
  2/1). ``tests/unit/test_reshard_plan.py`` pins this rule against torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ckptd.codec import ArrayLayout
from ckptd.errors import CheckpointError
from ckptd.layout import Box, choose_chunk_shape, chunk_box, interval_grid, plan_reads, read_cost
from ckptd.manifest import TensorEntry

__all__ = [
    "LayoutError",
    "LayoutSyntaxError",
    "MAX_OBJECTS_PER_BLOCK",
    "RankCost",
    "ReadPlan",
    "TargetLayout",
    "aligned_layout",
    "parse_layout",
    "plan_reads_for",
    "rank_box",
    "rank_boxes",
    "rank_cost",
    "saved_sharded",
    "sharded_keys",
    "strided_mismatch",
    "validate",
    "whole_chunks",
]

# A rechunked tensor whose ranks' blocks tile no regular grid gets the grid of the blocks'
# common divisor if that makes at most this many objects per block (else an even grid: ranks
# then read parts of the chunks at their boundaries).
MAX_OBJECTS_PER_BLOCK = 4


class LayoutSyntaxError(ValueError):
    """``--layout`` text that does not parse: bad usage (exit 2)."""


class LayoutError(CheckpointError):
    """The checkpoint cannot be restored at this layout and world size (exit 1)."""


@dataclass(frozen=True, slots=True)
class TargetLayout:
    """How the restoring job lays out its M ranks: ``kind`` is ``fsdp``, ``replicated`` or
    ``tp``; for ``tp``, ``tp * dp == world_size``."""

    kind: str
    world_size: int
    tp: int = 1
    dp: int = 1

    @property
    def spec(self) -> str:
        """Canonical ``--layout`` text."""
        return {"fsdp": "fsdp", "replicated": "ddp"}.get(self.kind, f"tp={self.tp},dp={self.dp}")

    @property
    def slug(self) -> str:
        """A name for files and folders: ``to_3_fsdp``, ``to_4_tp2_dp2``."""
        tail = f"tp{self.tp}_dp{self.dp}" if self.kind == "tp" else self.kind
        return f"to_{self.world_size}_{tail}"

    def describe(self) -> str:
        m = self.world_size
        if self.kind == "fsdp":
            return f"fsdp over {m} rank{'s' * (m != 1)} (dim 0 of sharded tensors split like torch.chunk)"
        if self.kind == "replicated":
            return f"replicated over {m} rank{'s' * (m != 1)} (every rank reads every tensor whole)"
        return (
            f"tp={self.tp} x dp={self.dp} over {m} ranks (dim 0 split over tp, then over dp; "
            "1-D tensors replicated over tp)"
        )

    def to_json(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "world_size": self.world_size, "tp": self.tp, "dp": self.dp}


_TP_PART = re.compile(r"^(tp|dp)=(\d+)$")


def parse_layout(text: str, world_size: int) -> TargetLayout:
    """Parse ``--layout`` for a job of ``world_size`` ranks. Raises :class:`LayoutSyntaxError`
    for text that is not a layout, :class:`LayoutError` for a layout that cannot be laid over
    ``world_size`` ranks."""
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise LayoutSyntaxError(f"world size must be an int, got {world_size!r}")
    if world_size < 1:
        raise LayoutError(f"cannot restore at world size {world_size}: a job needs at least 1 rank")
    t = text.strip().lower().replace(" ", "")
    if t in ("fsdp", "fsdp2"):
        return TargetLayout("fsdp", world_size, 1, world_size)
    if t in ("ddp", "replicated"):
        return TargetLayout("replicated", world_size, 1, 1)
    parts: dict[str, int] = {}
    for p in t.split(","):
        m = _TP_PART.match(p)
        if m is None or m.group(1) in parts:
            raise LayoutSyntaxError(f"invalid layout {text!r}: expected fsdp, ddp, replicated, tp=T, or tp=T,dp=D")
        parts[m.group(1)] = int(m.group(2))
    tp, dp = parts.get("tp"), parts.get("dp")
    for name, v in (("tp", tp), ("dp", dp)):
        if v is not None and v < 1:
            raise LayoutError(f"layout {text!r}: {name}={v} is not a mesh size (must be >= 1)")
    if tp is None:
        tp = world_size // dp if world_size % dp == 0 else 0
        if tp == 0:
            raise LayoutError(f"layout {text!r}: dp={dp} does not divide world size {world_size}")
    if dp is None:
        if world_size % tp:
            raise LayoutError(
                f"layout {text!r}: tp={tp} does not divide world size {world_size} "
                f"(a (dp, tp) mesh needs tp x dp = {world_size} ranks)"
            )
        dp = world_size // tp
    if tp * dp != world_size:
        raise LayoutError(f"layout {text!r}: tp x dp = {tp} x {dp} = {tp * dp} ranks, but the job has {world_size}")
    return TargetLayout("fsdp" if tp == 1 else "tp", world_size, tp, dp)


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of ``range(n)`` split into ``parts`` like ``torch.chunk`` (ceil; the last
    pieces may be short or empty), as (start, stop)."""
    c = -(-n // parts) if n else 0
    start = min(i * c, n)
    return start, min(start + c, n)


# A placement that shards, as the save records it (``str`` of torch placements joined by commas):
# ``S(0)``, ``_S(0, 2)`` (strided), or the ``Shard(dim=0)`` spelling of their repr.
_SHARD_RE = re.compile(r"(?:^|[,\s(])_?S\(|Shard")


def saved_sharded(placements: str) -> bool:
    return bool(_SHARD_RE.search(placements))


def sharded_keys(tensors: Mapping[str, TensorEntry]) -> frozenset[str]:
    """The tensors a target layout splits (see the module docstring)."""
    split = {k for k, e in tensors.items() if saved_sharded(e.placements) and e.layout.shape}
    return frozenset(split or (k for k, e in tensors.items() if e.layout.shape))


def rank_box(shape: Sequence[int], sharded: bool, target: TargetLayout, rank: int) -> Box:
    """The box of a tensor that rank ``rank`` of the target job holds."""
    shape = tuple(shape)
    if not sharded or not shape or target.kind == "replicated":
        return Box.full(shape)
    n = shape[0]
    if target.kind == "fsdp":
        a, b = _chunk(n, target.world_size, rank)
    else:
        d, t = divmod(rank, target.tp)
        if len(shape) == 1:
            a, b = _chunk(n, target.dp, d)
        else:
            ta, tb = _chunk(n, target.tp, t)
            da, db = _chunk(tb - ta, target.dp, d)
            a, b = ta + da, ta + db
    return Box((a, *[0] * (len(shape) - 1)), (b, *shape[1:]))


def rank_boxes(shape: Sequence[int], sharded: bool, target: TargetLayout) -> list[Box]:
    return [rank_box(shape, sharded, target, r) for r in range(target.world_size)]


@lru_cache(maxsize=4096)
def strided_mismatch(n: int, tp: int, dp: int) -> tuple[int, int, int, int] | None:
    """For dim 0 of ``n`` rows under FSDP2 (dp) over TP (tp): the first ``(dp index, tp index,
    rows FSDP2 holds, rows torch's metadata says)`` that disagree, or None when they all agree.

    torch describes the 2-D block with ``_StridedShard(0, split_factor=tp)`` on dp and
    ``Shard(0)`` on tp: dp rank d gets the d-th chunk of each of the tp chunks, concatenated,
    and tp rank t takes the t-th ``torch.chunk`` of that concatenation. That is FSDP2's block
    exactly when the t-th piece of the concatenation is the d-th chunk of TP block t."""
    for d in range(dp):
        sizes = []
        for t in range(tp):
            ta, tb = _chunk(n, tp, t)
            da, db = _chunk(tb - ta, dp, d)
            sizes.append(db - da)
        total = sum(sizes)
        for t in range(tp):
            a, b = _chunk(total, tp, t)
            if b - a != sizes[t] or a != sum(sizes[:t]):
                return d, t, sizes[t], b - a
    return None


def validate(tensors: Mapping[str, TensorEntry], target: TargetLayout, where: str = "") -> None:
    """Raise :class:`LayoutError` naming the first tensor the target layout cannot hold."""
    if target.kind != "tp" or target.dp == 1:
        return
    prefix = f"{where}: " if where else ""
    for key in sorted(sharded_keys(tensors)):
        shape = tensors[key].layout.shape
        if len(shape) < 2:
            continue
        bad = strided_mismatch(shape[0], target.tp, target.dp)
        if bad is not None:
            d, t, held, says = bad
            raise LayoutError(
                f"{prefix}key {key!r}: dim 0 of {shape[0]} rows cannot be split over tp={target.tp} x "
                f"dp={target.dp}: FSDP2 would put {held} rows on rank (dp={d}, tp={t}) where torch's "
                f"_StridedShard metadata says {says}, so a restore at this layout fails; use another "
                f"tp/dp split or --layout fsdp"
            )


@dataclass(frozen=True, slots=True)
class RankCost:
    """What one rank of the target job reads: ``bytes`` fetched (chunks with their crc32c),
    ``objects`` touched, ``needed`` bytes of its blocks."""

    rank: int
    bytes: int
    objects: int
    needed: int

    @property
    def amplification(self) -> float:
        """Bytes read per byte needed (1.0 for a rank that needs nothing)."""
        return self.bytes / self.needed if self.needed else 1.0

    def to_json(self) -> dict:
        return {"rank": self.rank} | _cost_json(self)


@dataclass(frozen=True)
class ReadPlan:
    """The reads of all M ranks of the target job."""

    target: TargetLayout
    ranks: tuple[RankCost, ...]

    @property
    def largest(self) -> RankCost:
        return max(self.ranks, key=lambda c: (c.bytes, c.objects, -c.rank))

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.ranks)

    @property
    def objects(self) -> int:
        return sum(c.objects for c in self.ranks)

    @property
    def needed(self) -> int:
        return sum(c.needed for c in self.ranks)

    amplification = RankCost.amplification

    def to_json(self) -> dict:
        return {"ranks": [c.to_json() for c in self.ranks], "largest_rank": self.largest.to_json()} | _cost_json(self)


def _cost_json(c: RankCost | ReadPlan) -> dict:
    return {
        "bytes": c.bytes,
        "objects": c.objects,
        "bytes_needed": c.needed,
        "amplification": round(c.amplification, 4),
    }


def rank_cost(tensors: Mapping[str, TensorEntry], sharded: Iterable[str], target: TargetLayout, rank: int) -> RankCost:
    """One rank's reads: O(tensors), each O(chunks touched)."""
    sharded = sharded if isinstance(sharded, frozenset | set) else frozenset(sharded)
    nbytes = objects = needed = 0
    for key, e in tensors.items():
        box = rank_box(e.layout.shape, key in sharded, target, rank)
        b, o = (0, 0) if e.value is not None else read_cost(e.layout, box)  # inline scalars: no object
        nbytes += b
        objects += o
        needed += box.volume * e.layout.itemsize
    return RankCost(rank, nbytes, objects, needed)


def plan_reads_for(tensors: Mapping[str, TensorEntry], target: TargetLayout, where: str = "") -> ReadPlan:
    """Validate ``target`` against the tensors and cost every rank's reads."""
    validate(tensors, target, where)
    sharded = sharded_keys(tensors)
    # Replicated tensors cost every rank the same: count them once.
    shared = {k: e for k, e in tensors.items() if k not in sharded or target.kind == "replicated"}
    base = rank_cost(shared, (), target, 0)
    split = {k: e for k, e in tensors.items() if k not in shared}
    ranks = []
    for r in range(target.world_size):
        c = rank_cost(split, sharded, target, r)
        ranks.append(RankCost(r, c.bytes + base.bytes, c.objects + base.objects, c.needed + base.needed))
    return ReadPlan(target, tuple(ranks))


def whole_chunks(layout: ArrayLayout, box: Box) -> bool:
    """Whether every chunk a read of ``box`` touches lies inside ``box`` (clipped to the array):
    the read fetches no byte of data it does not need, save the padding of an edge chunk."""
    touched = (chunk_box(layout, sr.shard, c) for sr in plan_reads(layout, box) for c in sr.chunks)
    return all(cb.intersect(box) == cb for cb in touched)


def aligned_layout(shape: Sequence[int], dtype: str, itemsize: int, blocks: Sequence[Box]) -> ArrayLayout:
    """The zarr layout of a tensor rewritten for ranks that hold ``blocks``: shards are the
    blocks when they tile a regular grid (FSDP's ``torch.chunk`` split, even products), else the
    blocks' common divisor grid when it stays coarse, else an even grid. Inner chunks divide the
    shard (:func:`ckptd.layout.choose_chunk_shape`), so a rank reads whole chunks only."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return ArrayLayout.empty(shape, dtype)
    distinct = {b for b in blocks if not b.empty}
    if not distinct or distinct == {Box.full(shape)}:
        from ckptd.stream import default_layout

        return default_layout(shape, dtype, itemsize)
    shard = []
    for d, n in enumerate(shape):
        ivs = {(b.start[d], b.stop[d]) for b in distinct}
        step = interval_grid(ivs, n)
        if step is None:
            g = math.gcd(*(math.gcd(a, b % n) for a, b in ivs))
            cells = -(-n // g) if g else 1
            step = g if g and cells <= MAX_OBJECTS_PER_BLOCK * len(ivs) else -(-n // len(ivs))
        shard.append(step)
    shard = tuple(shard)
    return ArrayLayout(shape, dtype, shard, choose_chunk_shape(shard, itemsize))
