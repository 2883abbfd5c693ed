"""The few small collectives that save and restore make, on a gloo group.

Only the training thread calls these, at the same point on every rank (inside ``save`` and
``restore``, which are collective). The background writer never uses the process group: the
commit is coordinated through storage. On NCCL jobs a separate gloo group is created once, in
the ``Checkpointer`` constructor (itself collective), because these exchange CPU objects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Coordinator"]


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
