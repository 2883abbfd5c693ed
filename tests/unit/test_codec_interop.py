"""Our zarr v3 encoder against the two reference readers: zarr-python and tensorstore."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from ckptd.codec import ArrayLayout, encode_shard
from ckptd.layout import Box, choose_chunk_shape, plan_reads


def write_array(root: str, layout: ArrayLayout, data: np.ndarray) -> None:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "zarr.json"), "w") as f:
        json.dump(layout.metadata(), f)
    for coord in layout.shard_coords():
        start, stop = layout.shard_box(coord)
        block = data[tuple(slice(a, b) for a, b in zip(start, stop, strict=True))]
        path = os.path.join(root, *layout.shard_key(coord).split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for b in encode_shard(layout, coord, block):
                f.write(b)


CASES = [
    # shape, dtype, shard, chunk
    ((10, 6), "float32", (4, 6), (2, 6)),  # sharded, short edge shard with an absent chunk
    ((10, 6), "float32", (10, 6), (10, 6)),  # plain, one chunk
    ((7, 5), "int64", (3, 5), (3, 5)),  # plain, padded edge chunk
    ((9,), "float16", (4,), (2,)),
    ((5, 4, 3), "bool", (2, 4, 3), (1, 4, 3)),
    ((), "float32", (), ()),  # 0-d
    ((6, 8), "float32", (6, 3), (3, 3)),  # TP column shards, padded in dim 1
]


@pytest.mark.parametrize("shape,dtype,shard,chunk", CASES)
def test_zarr_python_reads_what_we_write(tmp_path, shape, dtype, shard, chunk):
    zarr = pytest.importorskip("zarr")
    layout = ArrayLayout(shape, dtype, shard, chunk)
    rng = np.random.default_rng(0)
    data = (rng.random(shape) * 100).astype(np.dtype(dtype)) if dtype != "bool" else rng.random(shape) > 0.5
    write_array(str(tmp_path / "a"), layout, np.asarray(data))
    arr = zarr.open_array(str(tmp_path / "a"), mode="r")
    assert arr.shape == shape
    np.testing.assert_array_equal(arr[...], data)


@pytest.mark.parametrize("shape,dtype,shard,chunk", CASES + [((10, 6), "bfloat16", (4, 6), (2, 6))])
def test_tensorstore_reads_what_we_write(tmp_path, shape, dtype, shard, chunk):
    ts = pytest.importorskip("tensorstore")
    layout = ArrayLayout(shape, dtype, shard, chunk)
    np_dtype = layout.np_dtype
    rng = np.random.default_rng(1)
    data = (rng.random(shape) * 100).astype(np_dtype) if dtype != "bool" else rng.random(shape) > 0.5
    write_array(str(tmp_path / "a"), layout, np.asarray(data))
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "a")}}).result()
    got = arr.read().result()
    if dtype == "bfloat16":
        assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, data)


def test_chunk_shape_divides_shard_and_respects_floor():
    # 14 rows of 1 MiB: rows fit the 4 MiB cap, so whole rows, one per chunk (target 448 KiB)
    assert choose_chunk_shape((14, 262144), 4) == (1, 262144)
    # 16 MiB shard of 4 KiB rows: ~1/32 of the shard (512 KiB = 128 rows), dividing 4096
    assert choose_chunk_shape((4096, 1024), 4) == (128, 1024)
    # an explicit target
    assert choose_chunk_shape((14, 262144), 4, target=4 << 20) == (2, 262144)
    # prime extent: only 1 or the whole shard; 1 row is 64 KiB... = floor -> 1 row
    assert choose_chunk_shape((1009, 16384), 4) == (1, 16384)
    # prime extent with rows below the floor: the whole shard
    assert choose_chunk_shape((1009, 1024), 4) == (1009, 1024)
    # small shards stay one chunk
    assert choose_chunk_shape((8, 8), 4) == (8, 8)
    # rows larger than the 4 MiB cap split the next dimension too
    c = choose_chunk_shape((4, 4 * 1024 * 1024), 4)
    assert c[0] == 1 and (4 * 1024 * 1024) % c[1] == 0 and c[1] * 4 <= 4 * 1024 * 1024


def test_plan_reads_touches_only_needed_chunks():
    layout = ArrayLayout((100, 10), "float32", (25, 10), (5, 10))
    reads = plan_reads(layout, Box((30, 0), (41, 10)))
    assert [r.shard for r in reads] == [(1, 0)]
    assert reads[0].chunks == ((1, 0), (2, 0), (3, 0))
    reads = plan_reads(layout, Box((24, 0), (26, 10)))
    assert [(r.shard, r.chunks) for r in reads] == [((0, 0), ((4, 0),)), ((1, 0), ((0, 0),))]
