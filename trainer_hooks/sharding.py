"""Where a tensor's local data sits in its global tensor, for every rank.

The one place that touches torch's private ``_compute_local_shape_and_global_offset``: it gives
the box of a DTensor's local block for any mesh coordinate (FSDP2 ``torch.chunk`` splits, uneven
shards, ``_StridedShard`` for FSDP x TP on one dimension). ``tests/unit/test_sharding.py`` pins
its behaviour so a torch upgrade that changes it fails loudly instead of writing wrong boxes.
"""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from ckptd.errors import CheckpointError
from ckptd.layout import Box

__all__ = ["Sharding", "empty_box", "is_dtensor", "local_tensor", "owned_sharding", "sharding_of", "world"]


def is_dtensor(t: torch.Tensor) -> bool:
    # Not imported here: ``torch.distributed.tensor`` imports sympy, most of a second of
    # ``import trainer_hooks``. A DTensor exists only once its module has been imported.
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def empty_box(shape: tuple[int, ...]) -> Box:
    """The box of a rank that holds none of a tensor of ``shape``."""
    return Box.full((0,) * len(shape))


@dataclass(frozen=True)
class Sharding:
    """How one tensor is laid out across the job.

    ``signature`` identifies the layout (global shape, mesh, placements) so plans can be cached
    across saves; ``blocks()`` is every global rank's box, O(world size), computed once per
    distinct signature.
    """

    global_shape: tuple[int, ...]
    local_box: Box
    signature: tuple
    placements: str

    def blocks(self) -> list[Box]:
        return list(_blocks(self.signature))


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharding_of(t: torch.Tensor) -> Sharding:
    ws = world()[1]
    if not is_dtensor(t):
        return _plain_sharding(tuple(t.shape), ws)
    ranks, mesh_shape, coord = _mesh_info(t.device_mesh)
    return _dtensor_sharding(
        tuple(t.shape), mesh_shape, ranks, coord, tuple(t.placements), ws, tuple(t.to_local().shape)
    )


@lru_cache(maxsize=65536)
def _plain_sharding(shape: tuple[int, ...], ws: int) -> Sharding:
    """A plain tensor is whole on every rank. Cached: every save and restore asks per tensor."""
    return Sharding(shape, Box.full(shape), ("replicated", shape, ws), "replicated" if ws > 1 else "")


def owned_sharding(shape: tuple[int, ...], owner: int) -> Sharding:
    """A tensor held whole by global rank ``owner`` only (a ZeroRedundancyOptimizer's state of a
    parameter in ``owner``'s partition): the other ranks hold no block of it."""
    rank, ws = world()
    return _owned_sharding(shape, owner, rank, ws)


@lru_cache(maxsize=65536)
def _owned_sharding(shape: tuple[int, ...], owner: int, rank: int, ws: int) -> Sharding:
    if not 0 <= owner < ws:
        raise CheckpointError(f"a tensor owned by rank {owner} in a job of {ws} ranks")
    box = Box.full(shape) if rank == owner else empty_box(shape)
    return Sharding(shape, box, ("owned", shape, owner, ws), f"rank {owner}")


# Per device mesh (a job has a handful, alive for the whole run): its ranks in mesh order, its
# shape and this rank's coordinate. Reading them off the mesh costs a tensor flatten + tolist per
# call, which every save and restore would otherwise pay per tensor.
# Held by weak reference: a mesh that dies frees its entry's slot for a new mesh at its id.
_MESHES: dict[int, tuple[weakref.ref, tuple]] = {}


def _mesh_info(mesh) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    coord = mesh.get_coordinate()
    info = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), None if coord is None else tuple(coord))
    _MESHES[id(mesh)] = (weakref.ref(mesh), info)
    return info


@lru_cache(maxsize=65536)
def _dtensor_sharding(shape, mesh_shape, ranks, coord, placements, ws, local_shape) -> Sharding:
    sig = ("dtensor", shape, mesh_shape, ranks, placements, ws)
    if coord is None:
        box = empty_box(shape)
    else:
        box = _box(shape, mesh_shape, coord, placements)
        if tuple(box.shape) != local_shape:
            raise CheckpointError(
                f"DTensor local shape {local_shape} differs from the computed block "
                f"{box.shape} for placements {placements}: unsupported layout"
            )
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        _check_tiling(sig)
    return Sharding(shape, box, sig, ",".join(str(p) for p in placements))


def _box(shape, mesh_shape, coord, placements) -> Box:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    if not offset:
        offset = tuple(0 for _ in shape)
    return Box.from_offset(offset, local)


@lru_cache(maxsize=4096)
def _blocks(sig: tuple) -> tuple[Box, ...]:
    shape, ws = sig[1], sig[-1]
    if sig[0] == "replicated":
        return (Box.full(shape),) * ws
    out = [empty_box(shape)] * ws
    if sig[0] == "owned":
        out[sig[2]] = Box.full(shape)
        return tuple(out)
    _, shape, mesh_shape, ranks, placements, ws = sig
    for flat, coord in enumerate(itertools.product(*[range(n) for n in mesh_shape])):
        out[ranks[flat]] = _box(shape, mesh_shape, coord, placements)
    return tuple(out)


@lru_cache(maxsize=4096)
def _check_tiling(sig: tuple) -> None:
    """Strided placements can make a local block non-contiguous in the global tensor; we store
    boxes, so insist that the distinct blocks tile the tensor exactly."""
    boxes = set(_blocks(sig)) - {empty_box(sig[1])}
    if sum(b.volume for b in boxes) != math.prod(sig[1]):
        raise CheckpointError(
            f"placements {sig[4]} give local blocks that are not contiguous boxes of the global "
            f"tensor {sig[1]}; this layout is not supported yet"
        )
