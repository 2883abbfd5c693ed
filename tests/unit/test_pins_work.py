"""The work BLAKE3 pins add to a save (issue 36 item 3's cost), and where it runs.

A shard's pins go into the rank's done record only, after every put: the shard is handed to the
store before it is hashed, so the store's I/O starts at once and overlaps the hashing of the
shards behind it; ``CheckpointWriter`` (import, rechunk) likewise hashes on its pool's threads,
beside its other puts. An incremental save names each shard's content by its pins, which it computes
anyway, instead of hashing the shard's bytes a second time with sha256.
"""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import torch

from ckptd import persist, stream
from ckptd.verify import verify
from storage_backends import open_store
from storage_backends.local import LocalStore
from trainer_hooks import Checkpointer

SHAPE = (1024, 1024)  # 4 MiB of float32: an object image of several chunks


def test_a_shard_is_handed_to_the_store_before_it_is_hashed(tmp_path, monkeypatch):
    events: list[str] = []
    put_new, image_digests = LocalStore.put_new, persist.image_digests

    def spy_put(self, key, data):
        if "/c/" in key:
            events.append("put")
        return put_new(self, key, data)

    def spy_digests(*a):
        events.append("hash")
        return image_digests(*a)

    monkeypatch.setattr(LocalStore, "put_new", spy_put)
    monkeypatch.setattr(persist, "image_digests", spy_digests)
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, {"w": torch.rand(SHAPE)}).result()
    assert events == ["put", "hash"]


def test_an_incremental_save_hashes_no_shard_twice(tmp_path, monkeypatch):
    """Dedupe's content hash is a sha256 of the shard's BLAKE3 pins, not of its bytes; it
    still tells a changed shard from an unchanged one."""
    fed = []
    sha256 = hashlib.sha256

    class Counting:
        def __init__(self, data=b""):
            self.h = sha256(data)
            fed.append(len(data))

        def update(self, data):
            fed.append(memoryview(data).nbytes)
            self.h.update(data)

        def digest(self):
            return self.h.digest()

        def hexdigest(self):
            return self.h.hexdigest()

    state = {"a": torch.rand(SHAPE), "b": torch.rand(SHAPE)}
    with Checkpointer(str(tmp_path / "job"), incremental=True) as ck:
        monkeypatch.setattr(persist.hashlib, "sha256", Counting)
        first = ck.save(1, state).result()
        monkeypatch.undo()
        assert max(fed) < 1 << 16, f"sha256 read {max(fed)} bytes at once: a shard's data"
        state["b"] += 1
        second = ck.save(2, state).result()
        got = {k: torch.zeros(SHAPE) for k in state}
        assert ck.restore(got, step=2) == 2
    assert second.bytes_written < first.bytes_written  # "a" reused, "b" written again
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_an_import_hashes_on_the_writer_pool_beside_its_puts(tmp_path, monkeypatch):
    """``CheckpointWriter`` (import, rechunk) hashes each shard on its pool's threads after the
    shard's put, not on the caller's thread before handing the put over; its pins stay ``v`` 2
    and verify."""
    threads = []
    digests = stream.shard_digests

    def spy(bufs):
        threads.append(threading.current_thread().name)
        return digests(bufs)

    monkeypatch.setattr(stream, "shard_digests", spy)
    store = open_store(str(tmp_path / "job"))
    with stream.CheckpointWriter(store, step=3) as w:
        for i in range(3):
            w.write_tensor(f"model/w{i}", np.full(SHAPE, i, np.float32))
        w.set_state({})
    assert len(threads) == 3 and all(t.startswith("ckptd-stream") for t in threads), threads
    (rec,) = [o.key for o in store.list("step_0000000003/_done/") if o.key.endswith(".json")]
    assert json.loads(store.get(rec))["pins"]["v"] == 2
    assert verify(store, 3).ok
