"""Reading sub-boxes of arrays, on the zero-copy path (filesystem) and the copying path (memory):
every box, every dtype, 0-d and edge chunks, and corruption caught on both paths."""

import os

import ml_dtypes
import numpy as np
import pytest

from ckptd import catalog
from ckptd.codec import ArrayLayout
from ckptd.errors import CorruptChunkError
from ckptd.layout import Box
from ckptd.reader import CheckpointReader, ReadRequest
from ckptd.stream import CheckpointWriter
from storage_backends import open_store

ARRAYS = {
    "a/sharded": (np.arange(40 * 6, dtype=np.float32).reshape(40, 6), ArrayLayout((40, 6), "float32", (12, 6), (4, 6))),
    "a/plain": (np.arange(7 * 5, dtype=np.int64).reshape(7, 5), None),
    "a/bf16": (np.arange(20, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 5), None),
    "a/scalar": (np.array(3.5, dtype=np.float32), None),
    "a/cols": (np.arange(6 * 8, dtype=np.float32).reshape(6, 8), ArrayLayout((6, 8), "float32", (6, 3), (3, 3))),
    "a/bool": (np.arange(9) % 2 == 0, None),
}
BOXES = {
    "a/sharded": [Box((0, 0), (40, 6)), Box((5, 0), (30, 6)), Box((12, 0), (24, 6)), Box((3, 2), (17, 5))],
    "a/plain": [Box((0, 0), (7, 5)), Box((2, 1), (6, 4))],
    "a/bf16": [Box((0, 0), (4, 5)), Box((1, 0), (3, 5))],
    "a/scalar": [Box((), ())],
    "a/cols": [Box((0, 0), (6, 8)), Box((0, 3), (6, 6)), Box((1, 2), (5, 7))],
    "a/bool": [Box((0,), (9,)), Box((4,), (5,))],
}


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    uri = str(tmp_path / "root") if request.param == "file" else f"memory://reader-{os.getpid()}-{id(request)}"
    s = open_store(uri)
    with CheckpointWriter(s, 5) as w:
        for key, (arr, layout) in ARRAYS.items():
            w.write_tensor(key, arr, layout)
    return s


@pytest.mark.parametrize("key", list(ARRAYS))
def test_every_box_reads_back_exactly(store, key):
    m = catalog.load_manifest(store)
    reader = CheckpointReader(store, "step_0000000005")
    arr = ARRAYS[key][0]
    for box in BOXES[key]:
        out = np.empty(box.shape, dtype=arr.dtype)
        reader.read([ReadRequest(m.tensors[key], box, out)])
        np.testing.assert_array_equal(out, arr[box.relative_to(Box.full(arr.shape))])


def test_reads_only_needed_chunks(store):
    m = catalog.load_manifest(store)
    reader = CheckpointReader(store, "step_0000000005")
    out = np.empty((8, 6), dtype=np.float32)
    reader.read([ReadRequest(m.tensors["a/sharded"], Box((12, 0), (20, 6)), out)])
    # two 4-row chunks of 96 bytes (+4 crc each); no shard index: offsets follow from the layout
    assert reader.stats.bytes_read == 2 * (96 + 4)


def reorder_chunks(store, key, n):
    """Rewrite a 3-chunk shard with its chunks in reverse order and a matching index, as another
    zarr writer might lay it out."""
    import struct

    from ckptd.codec import crc_bytes

    data = store.get(key)
    chunks = [data[i * n : (i + 1) * n] for i in range(3)]
    index = b"".join(struct.pack("<QQ", (2 - i) * n, n) for i in range(3))
    store.put(key, b"".join(reversed(chunks)) + index + crc_bytes(index))


def test_shards_out_of_canonical_order_fail_verify(store):
    """The format promises each shard's chunks back to back in C order (readers rely on it to
    skip the index read); a shard rewritten in another order is reported, not read silently."""
    from ckptd.verify import verify

    entry = catalog.load_manifest(store).tensors["a/sharded"]
    assert verify(store, 5).ok
    reorder_chunks(store, "step_0000000005/arrays/a/sharded/c/1/0", entry.layout.chunk_nbytes + 4)
    report = verify(store, 5)
    assert not report.ok and "arrays/a/sharded" in report.errors[0] and "order" in report.errors[0]


@pytest.mark.parametrize("whole", [True, False])
def test_flipped_byte_is_caught(store, whole):
    m = catalog.load_manifest(store)
    key = "step_0000000005/arrays/a/sharded/c/1/0"
    data = bytearray(store.get(key))
    data[10] ^= 0x40
    store.put(key, bytes(data))
    reader = CheckpointReader(store, "step_0000000005")
    box = Box((12, 0), (24, 6)) if whole else Box((13, 1), (14, 3))  # zero-copy vs copying path
    out = np.empty(box.shape, dtype=np.float32)
    with pytest.raises(CorruptChunkError, match=r"arrays/a/sharded.*c/1/0.*crc32c"):
        reader.read([ReadRequest(m.tensors["a/sharded"], box, out)])


def test_partly_wanted_edge_chunks_share_the_one_read_of_their_shard(store):
    """A box that cuts a chunk at its edge still reads each shard's touched chunks in one
    request: whole chunks land straight in the output, the cut one goes through a scratch buffer."""
    m = catalog.load_manifest(store)
    reader = CheckpointReader(store, "step_0000000005")
    box = Box((13, 0), (24, 6))  # shard 1 holds rows 12..23: chunk 0 partly, chunks 1 and 2 whole
    out = np.empty(box.shape, dtype=np.float32)
    reader.read([ReadRequest(m.tensors["a/sharded"], box, out)])
    np.testing.assert_array_equal(out, ARRAYS["a/sharded"][0][13:24])
    assert (reader.stats.requests, reader.stats.bytes_read) == (1, 3 * (96 + 4))
