"""Object images: shards staged as the bytes of their own object, sent to disk without a copy.

The codec's image functions must produce exactly what ``encode_shard`` produces; a save through
``Checkpointer`` must use images for eligible shards, write the same objects, keep its snapshot
consistent while training goes on, and reuse the images across saves.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch

from ckptd import manifest as mf
from ckptd.codec import ArrayLayout, encode_shard, image_chunks, image_nbytes, init_image, seal_image
from ckptd.dtypes import as_numpy
from ckptd.verify import verify
from storage_backends import open_store
from trainer_hooks import Checkpointer
from trainer_hooks import checkpointer as checkpointer_mod

ELIGIBLE = [
    # shape, dtype, shard, chunk
    ((8, 6), "float32", (4, 6), (2, 6)),
    ((12, 3, 5), "bfloat16", (6, 3, 5), (1, 3, 5)),  # chunk of 30 bytes + crc: 17 elements
    ((32, 7), "uint8", (16, 7), (4, 7)),
    ((6, 4), "float64", (6, 4), (3, 4)),  # 96 + 4 bytes: not a whole number of 8-byte elements
    ((10, 6), "float32", (10, 6), (10, 6)),  # plain: one chunk and its crc, no index
    ((7,), "float64", (7,), (7,)),  # plain: any element size
]
NOT_AN_IMAGE = {((6, 4), "float64", (6, 4), (3, 4))}


def _image_of(layout: ArrayLayout, coord, block: np.ndarray) -> bytes | None:
    chunks = image_chunks(layout, coord, block.dtype.itemsize)
    if chunks is None:
        return None
    image = np.zeros(image_nbytes(layout, chunks), np.uint8)
    init_image(layout, image, chunks)
    stride = layout.chunk_nbytes + 4
    raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    for k in range(chunks):
        image[k * stride : k * stride + layout.chunk_nbytes] = raw[
            k * layout.chunk_nbytes : (k + 1) * layout.chunk_nbytes
        ]
    seal_image(layout, image, chunks)
    return image.tobytes()


@pytest.mark.parametrize("shape,dtype,shard,chunk", ELIGIBLE)
def test_an_image_is_byte_for_byte_the_encoded_shard(shape, dtype, shard, chunk):
    layout = ArrayLayout(shape, dtype, shard, chunk)
    rng = np.random.default_rng(0)
    data = (rng.random(shape) * 100).astype(layout.np_dtype)
    for coord in layout.shard_coords():
        start, stop = layout.shard_box(coord)
        block = data[tuple(slice(a, b) for a, b in zip(start, stop, strict=True))]
        got = _image_of(layout, coord, block)
        if (shape, dtype, shard, chunk) in NOT_AN_IMAGE:
            assert got is None
            continue
        assert got == b"".join(bytes(b) for b in encode_shard(layout, coord, block))


def test_shards_that_cannot_be_images():
    clipped = ArrayLayout((10, 6), "float32", (4, 6), (2, 6))  # the last shard holds 2 of 4 rows
    assert image_chunks(clipped, (0, 0), 4) == 2
    assert image_chunks(clipped, (2, 0), 4) is None
    columns = ArrayLayout((8, 8), "float32", (8, 4), (2, 4))  # TP column blocks: rows of the block
    assert image_chunks(columns, (0, 1), 4) == 4
    tiles = ArrayLayout((8, 8), "float32", (8, 4), (2, 2))  # a chunk is not whole rows of the shard
    assert image_chunks(tiles, (0, 1), 4) is None
    plain = ArrayLayout((8, 8), "float32", (8, 8), (8, 8))  # one chunk: data and crc
    assert image_chunks(plain, (0, 0), 4) == 1
    clipped_plain = ArrayLayout((7, 8), "float32", (4, 8), (4, 8))  # the last chunk is padded
    assert image_chunks(clipped_plain, (1, 0), 4) is None
    assert image_chunks(ArrayLayout((), "float32", (), ()), (), 4) is None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8))
        self.emb = torch.nn.Embedding(4096, 256).to(torch.bfloat16)
        self.square = torch.nn.Linear(512, 512)  # exactly 1 MiB: one chunk, not sharded


def big_state(seed=0):
    """Tensors over 1 MiB (sharded, so staged as images) in fp32 and bf16, plus small ones."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt}


def train(state):
    m = state["model"]
    loss = (
        m.seq(torch.randn(4, 512)).pow(2).mean()
        + m.square(torch.randn(2, 512)).pow(2).mean()
        + m.emb(torch.arange(8)).float().pow(2).mean()
    )
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()


@pytest.fixture
def spy_take(monkeypatch):
    """The SaveJobs that ``take`` returns (the real function; we only keep its result)."""
    jobs = []
    real = checkpointer_mod.take

    def take(*a, **k):
        job, entries = real(*a, **k)
        jobs.append(job)
        return job, entries

    monkeypatch.setattr(checkpointer_mod, "take", take)
    return jobs


def test_a_save_stages_images_and_writes_the_encoded_objects(tmp_path, spy_take):
    state = big_state()
    train(state)
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    job = spy_take[0]
    images = [sw for sw in job.shards if sw.image is not None]
    keys = {sw.key for sw in images}
    assert {"model/seq.0.weight", "optim/state/seq.0.weight/exp_avg", "model/emb.weight", "model/square.weight"} <= keys
    assert not next(sw for sw in images if sw.key == "model/square.weight").layout.sharded
    assert "model/seq.0.bias" not in keys  # 4 KiB: written through the page cache, no image
    store = open_store(root)
    for sw in images:
        assert sw.image.data_ptr() % 4096 == 0  # page-aligned: a direct write takes it as it is
        block = as_numpy(sw.buffer.reshape(-1, *sw.buffer.shape[2:]).contiguous())
        want = b"".join(bytes(b) for b in encode_shard(sw.layout, sw.coord, block))
        assert store.get(f"{mf.step_dir(1)}/{sw.object_key}") == want
    assert verify(store, 1).ok


def test_training_right_after_save_does_not_change_the_checkpoint(tmp_path):
    """The images are the snapshot: changing the parameters as soon as save returns (before
    the writer has read them) must not reach the checkpoint; the next save sees the change."""
    state = big_state()
    train(state)
    saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        fut = ck.save(1, state)
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(1)
        fut.result()
        after = {k: v.clone() for k, v in state["model"].state_dict().items()}
        ck.save(2, state).result()
        for step, want in ((1, saved), (2, after)):
            got = big_state(seed=9)
            train(got)
            assert ck.restore(got, step=step) == step
            for k, v in got["model"].state_dict().items():
                assert torch.equal(v, want[k]), (step, k)


def test_images_are_allocated_once_and_reused(tmp_path, spy_take):
    state = big_state()
    train(state)
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, state).result()
        staged = ck.staged_bytes
        train(state)
        ck.save(2, state).result()
        assert ck.staged_bytes == staged
    first, second = ({sw.key: sw.image.data_ptr() for sw in j.shards if sw.image is not None} for j in spy_take)
    assert first and first == second


def test_incremental_saves_reuse_unchanged_images(tmp_path):
    torch.manual_seed(0)
    state = {"w": {f"frozen{i}": torch.randn(512, 1024) for i in range(4)} | {"head": torch.randn(512, 1024)}}
    root = str(tmp_path / "job")
    with Checkpointer(root, incremental=True) as ck:
        first = ck.save(1, state).result()
        state["w"]["head"] += 1
        second = ck.save(2, state).result()
        assert 0 < second.bytes_written <= 0.25 * first.bytes_written
        got = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}}
        assert ck.restore(got) == 2
    assert all(torch.equal(state["w"][k], got["w"][k]) for k in state["w"])
    assert os.stat(os.path.join(root, mf.step_dir(2), mf.array_path("w/frozen0"), "c", "0", "0")).st_nlink == 2


def test_bf16_image_round_trips_through_tensorstore(tmp_path):
    ts = pytest.importorskip("tensorstore")
    torch.manual_seed(3)
    t = torch.randn(2048, 300).to(torch.bfloat16)
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, {"t": t}).result()
    arr = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(root, mf.step_dir(1), mf.array_path("t"))},
        }
    )
    got = arr.result().read().result()
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, as_numpy(t))


def test_non_contiguous_and_offset_tensors_are_staged_by_value(tmp_path, spy_take):
    """A transposed tensor and a view at an offset into a larger buffer are copied into their
    images element by element in C order, like any other tensor."""
    torch.manual_seed(5)
    base = torch.randn(3 * 512 * 1024 + 7)
    state = {
        "transposed": torch.randn(1024, 512).t(),  # 512 x 1024, strides (1, 512)
        "offset": base[7:].view(3 * 512, 1024),  # storage offset 7
    }
    assert not state["transposed"].is_contiguous() and state["offset"].storage_offset() == 7
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, state).result()
        got = {k: torch.zeros(v.shape) for k, v in state.items()}
        assert ck.restore(got) == 1
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert {sw.key for sw in spy_take[0].shards if sw.image is not None} == {"transposed", "offset"}


def test_a_tensor_that_changes_shape_gets_a_new_image(tmp_path, spy_take):
    """A key whose shape changes between saves (a resized embedding) is staged in a new image of
    the new layout; the old one is dropped, and each checkpoint holds its own values."""
    torch.manual_seed(6)
    small, big = torch.randn(512, 1024), torch.randn(768, 1024)
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, {"emb": small}).result()
        first = ck.staged_bytes
        ck.save(2, {"emb": big}).result()
        assert ck.staged_bytes > first and len(ck._stager._images) == 1
        for step, want in ((1, small), (2, big)):
            got = {"emb": torch.zeros(want.shape)}
            assert ck.restore(got, step=step) == step and torch.equal(got["emb"], want)
    images = [[sw.image for sw in j.shards if sw.image is not None] for j in spy_take]
    assert len(images[0]) == len(images[1]) == 1 and images[0][0].data_ptr() != images[1][0].data_ptr()
