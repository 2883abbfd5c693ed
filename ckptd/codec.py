"""Zarr v3 array metadata and the byte layout of its chunks and shards.

Every tensor of a checkpoint is one Zarr v3 array with the tensor's global shape. Two layouts:

* **sharded** (``shard_shape != chunk_shape``): the regular chunk grid has one *shard* per saving
  block, encoded with the ``sharding_indexed`` codec. A shard object is its inner chunks, each
  ``bytes`` (little endian, C order) followed by its 4-byte ``crc32c``, then an index of
  ``(offset, nbytes)`` uint64 pairs (C order over the inner-chunk grid) with its own ``crc32c``.
  Inner chunks wholly outside the array are absent (offset = nbytes = 2**64-1). A rank writes its
  shard whole, in one put, without reading anything; a reader fetches inner chunks by ranged GETs.
* **plain** (``shard_shape == chunk_shape``): small tensors; each chunk object is ``bytes`` +
  ``crc32c``.

We encode these bytes ourselves rather than through tensorstore/zarr-python so the hot path goes
through our own storage backends (one client, our retries, scatter-gather puts, ranged reads into
preallocated memory) with no extra copy; tensorstore and zarr-python read what we write, and the
tests hold us to that.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import blake3 as _blake3
import crc32c as _crc32c
import numpy as np

from ckptd.dtypes import DTYPE_ATTRIBUTE, NUMPY, STORED_AS, itemsize, numpy_dtype, stored_name
from ckptd.errors import CheckpointError, CorruptChunkError

__all__ = [
    "ArrayLayout",
    "CRC_BYTES",
    "EMPTY",
    "MAX_ARRAY_BYTES",
    "MAX_NDIM",
    "MAX_SMALL_GRID",
    "MIN_AVG_CHUNK_BYTES",
    "check_chunk",
    "check_metadata",
    "DIGEST_BYTES",
    "crc32c",
    "crc_bytes",
    "decode_chunk",
    "decode_index",
    "encode_shard",
    "image_chunks",
    "image_crcs",
    "image_digests",
    "part_digest",
    "shard_digests",
    "image_nbytes",
    "init_image",
    "inlinable",
    "inline_value",
    "max_object_bytes",
    "parse_inline",
    "seal_image",
]

EMPTY = 2**64 - 1
CRC_BYTES = 4

# Bounds on what a layout read from a checkpoint (or a hand-off) may declare, checked before
# anything is allocated or read from it: a crafted manifest with 1x1 chunks made restore spend
# 1.7 GB and 30 s on a 2 MiB tensor, and a shape of 10^12 elements a MemoryError. Layouts ckptd
# writes have chunks of 64 KiB or more (``layout.MIN_CHUNK_BYTES``) or few chunks, far inside.
MAX_NDIM = 32
MAX_ARRAY_BYTES = 1 << 39  # 512 GiB in one tensor
MAX_SMALL_GRID = 1 << 16  # any layout may have this many chunks ...
MIN_AVG_CHUNK_BYTES = 1024  # ... more only if they average at least this size


crc32c = _crc32c.crc32c


def crc_bytes(data) -> bytes:
    return struct.pack("<I", _crc32c.crc32c(data))


# A part's cryptographic pin (issue 36): BLAKE3 of its bytes as stored (a chunk and its crc32c,
# or the shard index and its crc32c), truncated to 128 bits. Unlike the crc32c, no 4 bytes make
# other contents keep it; a reader that checks it need not recompute the crc32c.
DIGEST_BYTES = 16


def part_digest(*bufs) -> bytes:
    """The BLAKE3 pin of one part: the concatenation of ``bufs`` (blake3 drops the GIL on big
    buffers, so writer and reader threads hash in parallel)."""
    h = _blake3.blake3()
    for b in bufs:
        h.update(b)
    return h.digest(DIGEST_BYTES)


def shard_digests(bufs: Sequence) -> bytes:
    """The BLAKE3 pin of each part of ``encode_shard``'s buffers ((bytes, crc32c) pairs), in order."""
    return b"".join(part_digest(bufs[i], bufs[i + 1]) for i in range(0, len(bufs), 2))


def inlinable(dtype: str) -> bool:
    """Whether a 0-d array of ``dtype`` may carry its value in ``fill_value`` (``inline_value``).

    Not float8 nor float4: tensorstore 0.1.86 parses a JSON number ``fill_value`` of
    ``float8_e8m0fnu`` wrongly (1.0 reads back as byte 63, 2**-64), and ``float4_e2m1fn_x2`` has
    no scalar value in torch; their 0-d arrays keep a chunk object of one byte."""
    return dtype in NUMPY and not dtype.startswith(("float8", "float4"))


def inline_value(dtype: str, value) -> Any:
    """``value`` (a Python scalar read from a 0-d tensor) as the JSON ``fill_value`` that stores
    it exactly, or None if it has no exact form there (NaN, whose bits JSON would not keep, and
    complex numbers; any dtype that is not ``inlinable``): such a scalar keeps its chunk object."""
    if not inlinable(dtype):
        return None
    if dtype == "bool":
        return bool(value)
    if dtype.startswith(("int", "uint")):
        return int(value)
    if dtype.startswith(("float", "bfloat")) and not math.isnan(v := float(value)):
        return v if math.isfinite(v) else ("Infinity" if v > 0 else "-Infinity")
    return None


def parse_inline(value) -> Any:
    """The Python value of an ``inline_value``."""
    return {"Infinity": math.inf, "-Infinity": -math.inf}.get(value, value) if isinstance(value, str) else value


def _fill_value(dtype: str):
    dtype = stored_name(dtype)
    if dtype == "bool":
        return False
    if dtype.startswith(("float", "bfloat", "complex")):
        return 0.0 if not dtype.startswith("complex") else [0.0, 0.0]
    return 0


@dataclass(frozen=True, slots=True)
class ArrayLayout:
    """Where an array's bytes are: global shape, dtype, shard grid and inner chunk shape."""

    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a string: {self.dtype!r}")
        for dims in (self.shape, self.shard_shape, self.chunk_shape):
            if not isinstance(dims, tuple) or not all(
                isinstance(n, int | np.integer) and not isinstance(n, bool) for n in dims
            ):
                raise ValueError(f"shapes must be lists of integers: {self}")
        if len(self.shape) != len(self.shard_shape) or len(self.shape) != len(self.chunk_shape):
            raise ValueError(f"rank mismatch in {self}")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"{len(self.shape)} dimensions, more than {MAX_NDIM}")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"negative extent in shape {list(self.shape)}")
        for s, c in zip(self.shard_shape, self.chunk_shape, strict=True):
            if c <= 0 or s <= 0 or s % c:
                raise ValueError(f"shard shape must be a positive multiple of chunk shape: {self}")
        self.check_bounds()

    def check_bounds(self) -> None:
        """ValueError if the layout declares more than any real tensor needs (see the bounds
        above): computed from the declared numbers only, allocating nothing."""
        nbytes = math.prod(self.shape) * (itemsize(self.dtype) if self.dtype in NUMPY else 1)
        if nbytes > MAX_ARRAY_BYTES:
            raise ValueError(f"shape {list(self.shape)} is {nbytes} bytes, more than {MAX_ARRAY_BYTES}")
        chunks = math.prod(-(-n // c) for n, c in zip(self.shape, self.chunk_shape, strict=True))
        if chunks > max(MAX_SMALL_GRID, nbytes // MIN_AVG_CHUNK_BYTES):
            raise ValueError(
                f"chunk shape {list(self.chunk_shape)} cuts shape {list(self.shape)} into {chunks} chunks "
                f"(under {MIN_AVG_CHUNK_BYTES} bytes each on average): refusing"
            )
        per_shard = math.prod(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))
        if per_shard > max(MAX_SMALL_GRID, chunks):
            raise ValueError(f"shard shape {list(self.shard_shape)} holds {per_shard} chunks: refusing")

    @property
    def sharded(self) -> bool:
        return self.shard_shape != self.chunk_shape

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Number of shards (objects) along each dimension."""
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shard_shape, strict=True))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize

    @property
    def index_nbytes(self) -> int:
        return math.prod(self.chunks_per_shard) * 16 + CRC_BYTES

    def shard_key(self, coord: Sequence[int]) -> str:
        """The object key of a shard (or plain chunk) relative to the array's folder."""
        return "/".join(["c", *map(str, coord)])

    def shard_coords(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*[range(g) for g in self.grid_shape])

    def shard_box(self, coord: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(start, stop) of a shard clipped to the array."""
        start = tuple(c * s for c, s in zip(coord, self.shard_shape, strict=True))
        stop = tuple(min(b + s, n) for b, s, n in zip(start, self.shard_shape, self.shape, strict=True))
        return start, stop

    def object_nbytes(self, coord: Sequence[int]) -> int:
        """The size of the object of shard ``coord`` as ckptd writes it: each chunk of the grid
        that lies in the array, with its crc32c, then the shard index (a plain chunk: the one
        chunk and its crc32c). What ``ls`` sums for a partial step and ``gc``'s restorability
        check expects of each object."""
        start, stop = self.shard_box(coord)
        present = math.prod(-(-(b - a) // c) for a, b, c in zip(start, stop, self.chunk_shape, strict=True))
        return image_nbytes(self, present if self.sharded else 1)

    def shard_extent(self, coord: Sequence[int]) -> tuple[int, ...]:
        """The shape of a shard clipped to the array."""
        start, stop = self.shard_box(coord)
        return tuple(b - a for a, b in zip(start, stop, strict=True))

    def metadata(self, attributes: dict | None = None, fill_value: Any = None) -> dict:
        """The array's ``zarr.json``. ``fill_value`` (a JSON scalar) replaces the dtype's zero:
        a 0-d array saved without a chunk object carries its value there."""
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        if self.sharded:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": inner,
                        "index_codecs": inner,
                        "index_location": "end",
                    },
                }
            ]
        else:
            codecs = inner
        attributes = dict(attributes or {})
        if self.dtype in STORED_AS:  # the torch dtype that the stored data type stands for
            attributes[DTYPE_ATTRIBUTE] = self.dtype
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": stored_name(self.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": _fill_value(self.dtype) if fill_value is None else fill_value,
            "codecs": codecs,
            "attributes": attributes,
        }

    def to_json(self) -> dict:
        """The layout as JSON: a manifest's tensor rows and a daemon hand-off's shards carry it."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "shard_shape": list(self.shard_shape),
            "chunk_shape": list(self.chunk_shape),
        }

    @classmethod
    def from_json(cls, d: dict) -> ArrayLayout:
        """The reverse of ``to_json`` (other keys of ``d`` are ignored). Raises what the
        constructor raises (ValueError) or KeyError/TypeError for a malformed ``d``."""
        return cls(tuple(d["shape"]), d["dtype"], tuple(d["shard_shape"]), tuple(d["chunk_shape"]))

    @classmethod
    def empty(cls, shape: Sequence[int], dtype: str) -> ArrayLayout:
        """The layout of an array with no elements: metadata only, one chunk that stands for
        no data (a zero extent gets a chunk extent of 1, which zarr requires)."""
        grid = tuple(max(1, n) for n in shape)
        return cls(tuple(shape), dtype, grid, grid)


_ABSENT = object()


def check_metadata(meta: Any, layout: ArrayLayout, value: Any = None) -> None:
    """CheckpointError unless ``meta`` (a parsed ``zarr.json``) is what ckptd writes for
    ``layout`` (``value``: an inline scalar's ``fill_value``): the same shape, data type, grid,
    key encoding and codecs (``bytes`` and ``crc32c``, inside ``sharding_indexed`` when sharded,
    for the chunks and the index alike). Only ``attributes`` may differ (a JSON object).

    Why exact: tensorstore and zarr-python decode whatever codecs a ``zarr.json`` names, so a
    crafted one adds a gzip or zstd codec and a small chunk that decompresses to gigabytes
    before any size is checked. With ckptd's codecs a decoded chunk is exactly as large as its
    stored bytes, which the readers cap. ``verify`` and the torch-free readers share this check."""
    if not isinstance(meta, dict):
        raise CheckpointError("zarr.json is not a JSON object")
    attributes = meta.get("attributes", _ABSENT)
    want = layout.metadata(attributes if isinstance(attributes, dict) else {}, fill_value=value)
    for k in sorted(set(want) | set(meta), key=str):
        got, exp = meta.get(k, _ABSENT), want.get(k, _ABSENT)
        if got is _ABSENT or exp is _ABSENT or got != exp or type(got) is not type(exp) and k != "fill_value":
            shown = "absent" if got is _ABSENT else repr(got)[:120]
            raise CheckpointError(f"zarr.json field {str(k)[:40]!r} is {shown}, not what ckptd writes for this array")


def max_object_bytes(layout: ArrayLayout) -> int:
    """The largest a shard (or plain chunk) object of this layout can be: read no more."""
    return image_nbytes(layout, math.prod(layout.chunks_per_shard))  # a plain layout: one chunk


def _padded(region: np.ndarray, shape: tuple[int, ...]) -> memoryview:
    """The bytes of a chunk: ``region`` zero-padded to ``shape`` (a view when it needs none)."""
    if region.shape == shape:
        out = np.ascontiguousarray(region)
    else:
        out = np.zeros(shape, dtype=region.dtype)
        out[tuple(slice(0, n) for n in region.shape)] = region
    return memoryview(out.reshape(-1).view(np.uint8))


def encode_shard(layout: ArrayLayout, coord: Sequence[int], block: np.ndarray) -> list:
    """The buffers whose concatenation is the object of shard ``coord``.

    ``block`` holds the shard's data clipped to the array (shape = shard box). Inner chunks that
    are whole and contiguous in ``block`` are passed through as views (no copy); only chunks at
    the array's edge are padded copies.
    """
    expect = layout.shard_extent(coord)
    if block.shape != expect:
        raise ValueError(f"shard {tuple(coord)} needs a block of shape {expect}, got {block.shape}")
    if not layout.sharded:
        view = _padded(block, layout.chunk_shape)
        return [view, crc_bytes(view)]
    cps = layout.chunks_per_shard
    index = np.full((*cps, 2), EMPTY, dtype="<u8")
    bufs: list = []
    offset = 0
    for ci in itertools.product(*[range(n) for n in cps]):
        lo = [i * c for i, c in zip(ci, layout.chunk_shape, strict=True)]
        if any(a >= n for a, n in zip(lo, expect, strict=True)):
            continue  # wholly outside the array: absent
        region = block[tuple(slice(a, a + c) for a, c in zip(lo, layout.chunk_shape, strict=True))]
        view = _padded(region, layout.chunk_shape)
        bufs += [view, crc_bytes(view)]
        index[ci] = (offset, view.nbytes + CRC_BYTES)
        offset += view.nbytes + CRC_BYTES
    ib = index.tobytes()
    return [*bufs, ib, crc_bytes(ib)]


# ------------------------------------------------------------------------------ object images
#
# A shard whose inner chunks are whole rows (so each chunk is a contiguous byte range of the
# shard) and which the array's edge does not clip can be staged as an *object image*: one buffer
# holding exactly the bytes ``encode_shard`` would produce, the data of chunk ``k`` at
# ``k * (chunk_nbytes + 4)`` with its checksum slot after it, then the index (plain layouts:
# one chunk and its checksum, no index). The snapshot copies the tensor's rows straight into
# their places (a strided view of the image), the writer fills the checksums in place and
# hands the store one contiguous, page-aligned buffer that a direct write sends to the disk
# without copying it (``storage_backends._direct``).


def image_chunks(layout: ArrayLayout, coord: Sequence[int], itemsize: int) -> int | None:
    """The number of chunks of shard ``coord``'s object image, or None when the shard cannot
    be staged as one: a 0-d array, a shard clipped by the array's edge (edge chunks are padded
    copies), chunks that are not whole rows, or (several chunks) a chunk stride that is not a
    whole number of elements."""
    if not layout.shape or layout.shard_extent(coord) != layout.shard_shape:
        return None
    if not layout.sharded:
        return 1
    if layout.chunk_shape[1:] != layout.shard_shape[1:] or (layout.chunk_nbytes + CRC_BYTES) % itemsize:
        return None
    return math.prod(layout.chunks_per_shard)


def image_nbytes(layout: ArrayLayout, chunks: int) -> int:
    return chunks * (layout.chunk_nbytes + CRC_BYTES) + (layout.index_nbytes if layout.sharded else 0)


def init_image(layout: ArrayLayout, image: np.ndarray, chunks: int) -> None:
    """Write the index (which depends on the layout only) at the end of a fresh image."""
    if not layout.sharded:
        return
    stride = layout.chunk_nbytes + CRC_BYTES
    index = np.empty((chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(chunks, dtype="<u8") * stride
    index[:, 1] = stride
    ib = index.tobytes()
    image[chunks * stride :] = np.frombuffer(ib + crc_bytes(ib), dtype=np.uint8)


def seal_image(layout: ArrayLayout, image: np.ndarray, chunks: int) -> None:
    """Put every chunk's crc32c into its slot: the image is then the shard's object."""
    c, stride = layout.chunk_nbytes, layout.chunk_nbytes + CRC_BYTES
    mv = memoryview(image)
    for k in range(chunks):
        struct.pack_into("<I", mv, k * stride + c, _crc32c.crc32c(mv[k * stride : k * stride + c]))


def image_crcs(layout: ArrayLayout, image: np.ndarray, chunks: int) -> bytes:
    """The crc32c of each part of a sealed image, as stored: each chunk's, then (sharded) the
    index's -- what ``encode_shard``'s checksum buffers hold for the same shard."""
    c, stride = layout.chunk_nbytes, layout.chunk_nbytes + CRC_BYTES
    mv = memoryview(image).cast("B")
    out = b"".join(bytes(mv[k * stride + c : k * stride + c + CRC_BYTES]) for k in range(chunks))
    return out + bytes(mv[-CRC_BYTES:]) if layout.sharded else out


def image_digests(layout: ArrayLayout, image: np.ndarray, chunks: int) -> bytes:
    """The BLAKE3 pin of each part of a sealed image: what ``shard_digests`` gives for the same shard."""
    stride = layout.chunk_nbytes + CRC_BYTES
    mv = memoryview(image).cast("B")
    out = [part_digest(mv[k * stride : (k + 1) * stride]) for k in range(chunks)]
    return b"".join(out + [part_digest(mv[chunks * stride :])] if layout.sharded else out)


def check_chunk(layout: ArrayLayout, data: bytes | memoryview, where: str, crc: bool = True) -> memoryview:
    """Check a chunk's size and crc32c; its body. ``where`` names the chunk in the error message.
    Needs no numpy dtype (a check of a bfloat16 chunk imports no ``ml_dtypes``). ``crc=False``:
    the size only (the caller checked the chunk against its BLAKE3 pin)."""
    mv = memoryview(data)
    if mv.nbytes != layout.chunk_nbytes + CRC_BYTES:
        raise CorruptChunkError(f"{where}: chunk has {mv.nbytes} bytes, expected {layout.chunk_nbytes + CRC_BYTES}")
    if crc and not _crc_ok(mv):
        raise CorruptChunkError(f"{where}: crc32c mismatch (corrupt chunk)")
    return mv[:-CRC_BYTES]


def _crc_ok(data) -> bool:
    """Whether ``data`` ends in the crc32c of the rest."""
    return crc32c(data[:-CRC_BYTES]) == struct.unpack("<I", data[-CRC_BYTES:])[0]


def decode_chunk(layout: ArrayLayout, data: bytes | memoryview, where: str, crc: bool = True) -> np.ndarray:
    """``check_chunk``, then the chunk as an array of ``chunk_shape``."""
    return np.frombuffer(check_chunk(layout, data, where, crc), dtype=layout.np_dtype).reshape(layout.chunk_shape)


def decode_index(layout: ArrayLayout, data: bytes, where: str) -> np.ndarray:
    """Check and parse a shard index: an array of shape ``chunks_per_shard + (2,)``."""
    if len(data) != layout.index_nbytes:
        raise CorruptChunkError(f"{where}: shard index has {len(data)} bytes, expected {layout.index_nbytes}")
    if not _crc_ok(data):
        raise CorruptChunkError(f"{where}: crc32c mismatch in shard index (corrupt shard)")
    return np.frombuffer(data[:-CRC_BYTES], dtype="<u8").reshape((*layout.chunks_per_shard, 2))
