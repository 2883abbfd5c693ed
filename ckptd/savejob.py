"""What a writer persists for one rank's part of one checkpoint: the hand-off types.

A ``SaveJob`` is built by the snapshot (``trainer_hooks.snapshot.take``) in the training
process, or by the daemon from a hand-off's staging files (``ckptd.server.handoff.load``), and
written by the commit protocol. Its buffers are whatever holds the snapshot (torch tensors on the
trainer side, mappings of staging files in the daemon); this module only describes them and
imports no torch.

``format_image`` prepares an *object image* (a shard's buffer laid out as its stored object,
``ckptd.codec``) for a snapshot to copy into; the writer fills in the checksums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ckptd import manifest as mf
from ckptd.codec import CRC_BYTES, ArrayLayout, init_image

if TYPE_CHECKING:
    import torch

__all__ = ["SaveJob", "ShardWrite", "format_image", "format_image_np"]


@dataclass
class ShardWrite:
    """One shard (one stored object) of array ``key`` that this rank writes."""

    key: str
    layout: ArrayLayout
    coord: tuple[int, ...]
    buffer: torch.Tensor  # host copy of the shard's data clipped to the array
    # With an object image: ``buffer`` is a (chunks, *chunk_shape) view into ``image`` (uint8,
    # the whole object; the writer fills in the checksums), and ``chunks`` its first extent.
    image: torch.Tensor | None = None

    @property
    def chunks(self) -> int:
        return self.buffer.shape[0]

    @property
    def object_key(self) -> str:
        return f"{mf.array_path(self.key)}/{self.layout.shard_key(self.coord)}"


@dataclass
class SaveJob:
    """Everything a writer needs to persist one rank's part of one checkpoint."""

    step: int
    attempt: str
    rank: int
    world_size: int
    shards: list[ShardWrite] = field(default_factory=list)
    metadata: list[tuple[str, bytes]] = field(default_factory=list)  # (key in folder, bytes)
    done: dict = field(default_factory=dict)  # extra fields of this rank's done record
    ready: object = None  # a CUDA event to wait for before reading the buffers, or None

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.nbytes for s in self.shards)


def format_image(image: torch.Tensor, layout: ArrayLayout, chunks: int, dtype) -> torch.Tensor:
    """Write the index into a fresh object image (uint8, ``image_nbytes`` long) and return the
    (chunks, *chunk_shape) view of its data: chunk ``k`` starts at ``k * (chunk_nbytes + 4)``
    bytes, its crc slot after it (``ckptd.codec.image_chunks``)."""
    init_image(layout, image.numpy(), chunks)
    stride = (layout.chunk_nbytes + CRC_BYTES) // dtype.itemsize  # whole elements whenever chunks > 1
    data = image[: (chunks - 1) * stride * dtype.itemsize + layout.chunk_nbytes].view(dtype)
    return data.as_strided((chunks, *layout.chunk_shape), (stride, *_row_strides(layout, 1)))


def format_image_np(image: np.ndarray, layout: ArrayLayout, chunks: int, dtype: np.dtype) -> np.ndarray:
    """``format_image`` for a numpy image (the daemon's mapping of a staging file; no torch):
    the same (chunks, *chunk_shape) view of its data, with byte strides."""
    init_image(layout, image, chunks)
    stride = layout.chunk_nbytes + CRC_BYTES
    data = image[: (chunks - 1) * stride + layout.chunk_nbytes].view(dtype)
    strides = (stride, *_row_strides(layout, dtype.itemsize))
    return np.lib.stride_tricks.as_strided(data, (chunks, *layout.chunk_shape), strides, writeable=False)


def _row_strides(layout: ArrayLayout, unit: int) -> list[int]:
    """The C-order strides of a chunk's dimensions (``unit`` for the last one)."""
    return [unit * math.prod(layout.chunk_shape[d + 1 :]) for d in range(len(layout.chunk_shape))]
