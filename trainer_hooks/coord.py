"""The few small collectives that save and restore make, on a gloo group.

Only the training thread calls these, at the same point on every rank (inside ``save`` and
``restore``, which are collective). The background writer never uses the process group: the
commit is coordinated through storage. On NCCL jobs a separate gloo group is created once, in
the ``Checkpointer`` constructor (itself collective), because these exchange CPU objects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ckptd.errors import CheckpointError, CheckpointNotFoundError, CorruptChunkError, StateMismatchError
from storage_backends import StorageError

__all__ = ["ERRORS", "Coordinator", "from_rank0"]

# The errors a failure agreed on (or broadcast) is raised as again on every rank, by class name.
ERRORS = {c.__name__: c for c in (CheckpointError, CheckpointNotFoundError, CorruptChunkError, StateMismatchError)}


class Coordinator:
    def __init__(self, group=None):
        self.enabled = dist.is_available() and dist.is_initialized()
        if not self.enabled:
            self.rank, self.world_size, self.group = 0, 1, None
            return
        if group is None:
            group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def broadcast(self, obj, src: int = 0):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_max(self, values: list[int]) -> list[int]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def agree(self, error):
        """Every rank learns whether any rank failed, and the first failing rank's error (a
        message, or a (kind, message) pair). Two collectives; no rank gathers O(ranks) data."""
        if not self.enabled:
            return error
        ws = self.world_size
        first = self.all_max([ws - self.rank if error is not None else 0])[0]
        if first == 0:
            return None
        src = ws - first
        got = self.broadcast(error if self.rank == src else None, src=src)
        if ws == 1 or src == self.rank:
            return got
        if isinstance(got, tuple | list):
            return type(got)([got[0], f"(on rank {src}) {got[1]}"])
        return f"(on rank {src}) {got}"


def from_rank0(coord, fn, fail=None):
    """Rank 0 of ``coord`` calls ``fn()`` and every rank gets its result. Where it raises
    CheckpointError or StorageError: with ``fail``, every rank gets what rank 0's ``fail(error)``
    returns; without, rank 0 raises the error and the others one of its class and message (a
    CheckpointError for a StorageError). Only ``coord.rank`` and ``coord.broadcast`` are used."""
    got = err = None
    if coord.rank == 0:
        try:
            got = fn()
        except (CheckpointError, StorageError) as e:
            if fail is None:
                err = e
            else:
                got = fail(e)
    ok, got = coord.broadcast((True, got) if err is None else (False, (type(err).__name__, str(err))))
    if err is not None:
        raise err
    if not ok:
        raise ERRORS.get(got[0], CheckpointError)(got[1])
    return got
