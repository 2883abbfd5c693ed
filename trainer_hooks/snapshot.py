"""Taking a snapshot: plan who writes what, and copy it into reusable host buffers.

This is the only part of a save that blocks training. For each tensor, the rank copies exactly
the shards it will write (its own block for FSDP/TP; its share of a replicated parameter; all of
a replicated buffer when it is the lowest rank holding it, see ``Flat.synced``) into
buffers that are allocated once and reused by every later save (pinned, and filled on a side
CUDA stream, when the tensor is on a GPU). A CPU shard of 1 MiB or more whose chunks are whole
rows is copied straight into an *object image* (``ckptd.codec.image_chunks``): a page-aligned
buffer laid out as the shard's object, so that the writer sends it to the disk without
encoding or copying it. A small sharded tensor's one shard (see ``ckptd.layout``) receives the
other ranks' blocks here, and so do shards whose rows straddle ranks (the irregular 2-D case)
from their neighbours. CPU scalars are not copied: their value goes into the manifest and
their ``zarr.json``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, image_chunks, image_nbytes, inlinable, inline_value
from ckptd.dtypes import zarr_dtype
from ckptd.layout import GATHER_SMALL_BYTES, Box, Grid, plan_grid
from ckptd.savejob import SaveJob, ShardWrite, format_image
from storage_backends import DIRECT_MIN_BYTES
from trainer_hooks.flatten import Flat
from trainer_hooks.hostcopy import copy_all
from trainer_hooks.sharding import Sharding, empty_box, local_tensor

__all__ = ["Planner", "Stager", "staged_image_chunks", "take"]


class Stager:
    """Reusable host buffers, one per (array key, shard). Not thread-safe: the training thread
    owns it, and a new save only starts after the previous one is persisted."""

    images = True  # stage eligible CPU shards as object images (a subclass may not)

    def __init__(self):
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._images: dict[
            tuple[str, tuple[int, ...]], tuple[ArrayLayout, torch.dtype, torch.Tensor, torch.Tensor]
        ] = {}

    def buffer(self, key: str, coord: tuple[int, ...], shape: tuple[int, ...], dtype, pin: bool) -> torch.Tensor:
        buf = self._buffers.get((key, coord))
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            self._images.pop((key, coord), None)
            buf = self._alloc(shape, dtype, pin)
            self._buffers[(key, coord)] = buf
        return buf

    def image(
        self, key: str, coord: tuple[int, ...], layout: ArrayLayout, dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(chunked view, image)`` for shard ``coord`` of ``key``, or None when it cannot be
        staged as an object image (``image_chunks``)."""
        hit = self._images.get((key, coord))
        if hit is not None and hit[0] == layout and hit[1] == dtype:
            return hit[2], hit[3]
        chunks = staged_image_chunks(layout, coord, dtype)
        if chunks is None:
            return None
        self._buffers.pop((key, coord), None)
        image = self._alloc_image(image_nbytes(layout, chunks))
        view = format_image(image, layout, chunks, dtype)
        self._images[(key, coord)] = (layout, dtype, view, image)
        return view, image

    @staticmethod
    def _alloc_image(nbytes: int) -> torch.Tensor:
        # An anonymous map is page-aligned, as a direct write needs; the tensor keeps it alive.
        # Private: not shared with processes forked later (data loader workers).
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)

    @staticmethod
    def _alloc(shape: tuple[int, ...], dtype, pin: bool) -> torch.Tensor:
        # Pinned (page-locked) host memory is what lets a D2H copy run asynchronously.
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values()) + sum(i[3].nbytes for i in self._images.values())

    @cached_property
    def stream(self):
        """The side CUDA stream the device-to-host copies run on, made at first use."""
        return torch.cuda.Stream()

    def release(self) -> None:
        self._buffers.clear()
        self._images.clear()


def staged_image_chunks(layout: ArrayLayout, coord: tuple[int, ...], dtype) -> int | None:
    """The chunk count of the object image to stage shard ``coord`` in, or None for a plain
    buffer: the shard cannot be an image, or its object is under 1 MiB (written through the page
    cache, where an image gains nothing)."""
    chunks = image_chunks(layout, coord, dtype.itemsize)
    if chunks is None or image_nbytes(layout, chunks) < DIRECT_MIN_BYTES:
        return None
    return chunks


@dataclass(frozen=True)
class _KeyPlan:
    """What one key's snapshot does on this rank, precomputed once per (key, layout): the
    manifest entry, this rank's ``zarr.json`` (if it writes it), and per shard the buffer shape
    and the slices to copy (``None`` when the rank holds none of the shard's rows)."""

    grid: Grid
    entry: mf.TensorEntry
    meta: tuple[str, bytes] | None
    shards: tuple[tuple[tuple[int, ...], Box, tuple | None, tuple | None, bool], ...]


class Planner:
    """Caches grids across tensors and saves: one per distinct (sharding, dtype), so planning
    costs O(ranks) per signature, not per tensor; and per key the rank's copy plan, so a save
    of an unchanged layout does no planning at all."""

    def __init__(self):
        self._cache: dict[tuple, Grid] = {}
        self._meta: dict[tuple, bytes] = {}
        self._keys: dict[tuple, _KeyPlan] = {}
        self._inline: dict[tuple, bytes] = {}
        # Sharded tensors up to this size are gathered into one shard (``ckptd.layout``).
        self.gather_small = int(os.environ.get("CKPTD_GATHER_SMALL_BYTES") or GATHER_SMALL_BYTES)

    def _grid(self, sh: Sharding, t: torch.Tensor, dtype: str, pinned: bool) -> tuple[Grid, bytes]:
        ck = (sh.signature, dtype, pinned)
        grid = self._cache.get(ck)
        if grid is None:
            blocks = sh.blocks()
            if pinned:
                # Only the lowest rank of each replica group holds its block, as far as the plan
                # knows: it writes (and sends) every piece, and the layout stays what the
                # distinct blocks make it (no split of a large replicated tensor over ranks).
                first: dict = {}
                empty = empty_box(sh.global_shape)
                blocks = [b if first.setdefault(b, r) == r else empty for r, b in enumerate(blocks)]
            grid = plan_grid(sh.global_shape, t.element_size(), dtype, blocks, gather_small=self.gather_small)
            self._cache[ck] = grid
            self._meta[ck] = mf.dumps(grid.layout.metadata())
        return grid, self._meta[ck]

    def inline_meta(self, layout: ArrayLayout, value) -> bytes:
        """The ``zarr.json`` of an inline scalar holding ``value``. The step counts of one
        optimizer all hold the same value, so one encoding serves them all; only the latest
        values are kept."""
        k = (layout, repr(value))  # repr: -0.0 and 0.0 are equal keys but different bytes
        b = self._inline.get(k)
        if b is None:
            if len(self._inline) > 4096:
                self._inline.clear()
            b = self._inline[k] = mf.dumps(layout.metadata(fill_value=value))
        return b

    def key_plan(self, key: str, t: torch.Tensor, sh: Sharding, rank: int, pinned: bool = False) -> _KeyPlan:
        """``pinned``: the replicas of ``t`` may differ (``Flat.synced``); each shard is written
        by the lowest rank that holds it, never by a load-balanced pick."""
        dtype = zarr_dtype(t.dtype, key)
        kk = (key, sh.signature, dtype, rank, pinned)
        kp = self._keys.get(kk)
        if kp is None:
            grid, meta = self._grid(sh, t, dtype, pinned)
            shards = []
            for coord in grid.shards_of(key, rank):
                box = Box(*grid.layout.shard_box(coord))
                own = box.intersect(sh.local_box)
                dst = own.relative_to(box) if own is not None else None
                src = own.relative_to(sh.local_box) if own is not None else None
                shards.append((coord, box, dst, src, own == box))
            runs = grid.writer_runs(key) if rank == 0 else None  # rank 0 writes the manifest
            kp = _KeyPlan(
                grid,
                mf.TensorEntry(key, grid.layout, sh.placements, writers=_bounded(runs)),
                (f"{mf.array_path(key)}/zarr.json", meta) if grid.meta_writer(key) == rank else None,
                tuple(shards),
            )
            self._keys[kk] = kp
        return kp


def _bounded(runs):
    """Writer runs the manifest keeps (``TensorEntry.writers``); None past the cap (a restore
    then reads every done record's pins)."""
    return runs if runs is not None and len(runs) <= mf.MAX_WRITER_RUNS else None


def take(
    flat: Flat,
    step: int,
    attempt: str,
    rank: int,
    world_size: int,
    stager: Stager,
    planner: Planner,
    pool: Executor | None = None,
) -> tuple[SaveJob, dict[str, mf.TensorEntry]]:
    """Copy this rank's shards into host buffers and describe the writes. Collective (point to
    point) when a tensor is gathered into one shard (sharded tensors of at most
    ``Planner.gather_small`` bytes) or needs boundary rows from another rank (irregular 2-D).
    The copies from CPU tensors are made together at the end, on ``pool`` (``hostcopy``)."""
    job = SaveJob(step, attempt, rank, world_size)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, CPU source): hostcopy.copy_all
    entries: dict[str, mf.TensorEntry] = {}
    # (tag, "send"|"recv", peer, tensor, where to put received rows). A tag is the key's index in
    # state order (which every rank walks identically) times a stride, plus the transfer's index
    # within the key (which both ends compute alike): unique, and agreed on without messages.
    p2p: list[tuple[int, str, int, torch.Tensor, tuple | None]] = []
    stride = 4 * world_size + 4
    cuda_used = False
    for n, (key, t) in enumerate(flat.tensors.items()):
        sh = flat.sharding(key)
        kp = planner.key_plan(key, t, sh, rank, pinned=key not in flat.synced)
        plan = kp.grid
        local = local_tensor(t).detach()
        on_cuda = local.is_cuda
        if not sh.global_shape and not on_cuda and inlinable(plan.layout.dtype):
            # A CPU scalar (an optimizer's step count) goes into its zarr.json's fill_value and
            # the manifest instead of a chunk object of a few bytes: one object, not two. Rank 0
            # (manifest) and the writer (zarr.json) each decide from their own replica's value.
            value = inline_value(plan.layout.dtype, local.item())
            if value is not None:
                entries[key] = dataclasses.replace(kp.entry, value=value)
                if kp.meta is not None:
                    job.metadata.append((kp.meta[0], planner.inline_meta(plan.layout, value)))
                continue
        entries[key] = kp.entry
        if kp.meta is not None:
            job.metadata.append(kp.meta)
        cuda_used |= on_cuda
        bufs: dict[tuple[int, ...], tuple[torch.Tensor, Box]] = {}
        for coord, box, dst, src, whole in kp.shards:
            staged = None
            if whole and plan.regular and not on_cuda and stager.images:
                staged = stager.image(key, coord, plan.layout, t.dtype)
            if staged is not None:  # the rows land in their chunks' places in the object image
                buf, image = staged
                copies.append((buf, local[src].unflatten(0, (buf.shape[0], buf.shape[1]))))
                job.shards.append(ShardWrite(key, plan.layout, coord, buf, image))
                continue
            buf = stager.buffer(key, coord, box.shape, t.dtype, pin=on_cuda)
            if dst is not None and on_cuda:
                _copy_cuda(buf[dst], local[src], stager)
            elif dst is not None:
                copies.append((buf[dst], local[src]))
            bufs[coord] = (buf, box)
            job.shards.append(ShardWrite(key, plan.layout, coord, buf))
        if plan.regular:
            continue
        # Pieces travel on the tensor's own device (NCCL for CUDA tensors, gloo for CPU ones).
        for j, tr in plan.transfers_of(key, rank):
            tag = n * stride + j
            if tr.src == rank:
                p2p.append((tag, "send", tr.dst, local[tr.box.relative_to(sh.local_box)].contiguous(), None))
            if tr.dst == rank:
                coord = tuple(a // s for a, s in zip(tr.box.start, plan.layout.shard_shape, strict=True))
                buf, box = bufs[coord]
                tmp = torch.empty(tr.box.shape, dtype=t.dtype, device=local.device)
                p2p.append((tag, "recv", tr.src, tmp, (buf, tr.box.relative_to(box))))
    copy_all(copies, pool)
    if cuda_used:
        ev = torch.cuda.Event()
        ev.record(stager.stream)
        # Training may overwrite parameters right after save returns: make its stream wait for
        # the copies (GPU-side ordering, no host stall).
        torch.cuda.current_stream().wait_event(ev)
        job.ready = ev
    if p2p:
        _exchange(p2p)
    return job, entries


def _copy_cuda(dst: torch.Tensor, src: torch.Tensor, stager: Stager) -> None:
    stream = stager.stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        src.record_stream(stream)


def _exchange(p2p) -> None:
    ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=tag) for tag, kind, peer, t, _ in p2p]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for _, kind, _, tensor, target in p2p:
        if kind == "recv":
            buf, where = target
            buf[where].copy_(tensor)
