from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from storage_backends import LocalStore, NotFoundError, StorageError
from storage_backends._direct import (
    DIRECT_BUFFER_BYTES,
    DIRECT_MIN_BYTES,
    BouncePool,
    DirectUnsupported,
    open_direct,
    write_direct,
)
from storage_backends._local_fs import advance as _advance
from storage_backends.testing import FilesystemConformance, StoreConformance, assert_empty_store


class TestLocalStore(StoreConformance, FilesystemConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LocalStore]:
        # The root does not exist yet: the first put must create it.
        with LocalStore(str(tmp_path / "job")) as s:
            yield s


def test_missing_root_is_an_empty_store(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "not" / "yet"))
    assert_empty_store(store)
    store.put("a/k", b"v")
    assert store.exists_root()
    assert (tmp_path / "not" / "yet" / "a" / "k").read_bytes() == b"v"


def test_temp_files_are_hidden(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("d/real", b"x")
    (tmp_path / "d" / ".real.tmp.1.2.abcd").write_bytes(b"partial")
    (tmp_path / ".top.tmp.1.2.abcd").write_bytes(b"partial")
    assert [i.key for i in store.list()] == ["d/real"]
    assert store.list_dir("d/") == (["real"], [])
    assert store.list_dir() == ([], ["d"])


def test_no_temp_files_left(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("a/b", b"1")
    store.put("a/b", b"2")
    assert store.put_if_absent("a/b", b"3") is False
    assert store.put_if_absent("a/c", b"4") is True
    store.copy("a/b", "a/d")
    assert sorted(os.listdir(tmp_path / "a")) == ["b", "c", "d"]


def test_delete_prunes_empty_folders(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "root"))
    store.put("a/b/c/d", b"x")
    store.put("a/keep", b"y")
    store.delete("a/b/c/d")
    assert sorted(os.listdir(tmp_path / "root" / "a")) == ["keep"]
    store.delete("a/keep")
    assert os.listdir(tmp_path / "root") == []  # the root itself stays
    store.put("a/b/c/d", b"again")  # the folder cache must not believe a/b/c still exists
    assert store.get("a/b/c/d") == b"again"
    store.put("x/1", b"1")
    store.put("x/y/2", b"2")
    assert store.delete_prefix("x/") == 2
    assert sorted(os.listdir(tmp_path / "root")) == ["a"]


def test_copy_is_a_hard_link_and_independent(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("src", b"v1")
    store.copy("src", "dst")
    assert os.stat(tmp_path / "src").st_ino == os.stat(tmp_path / "dst").st_ino
    store.put("src", b"v2")  # put replaces the inode, so the link keeps the old content
    assert store.get("dst") == b"v1"


def test_put_more_buffers_than_iov_max(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    parts = [bytes([i % 251]) * (i % 7 + 1) for i in range(3000)]
    store.put("many", parts)
    assert store.get("many") == b"".join(parts)
    outs = [bytearray(len(p)) for p in parts]
    store.get_range_into("many", 0, outs)
    assert outs == [bytearray(p) for p in parts]


def test_get_range_into_numpy(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    src = np.arange(1000, dtype=np.float64)
    store.put("arr", [b"header!!", memoryview(src)])
    dst = np.zeros((10, 100), dtype=np.float64)  # 2-D destination is fine when C-contiguous
    store.get_range_into("arr", 8, [memoryview(dst)])
    assert np.array_equal(dst.ravel(), src)


def test_advance_cursor() -> None:
    views = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"fghi")]
    assert _advance(views, 0, 0, 0) == (0, 0)
    assert _advance(views, 0, 0, 2) == (0, 2)
    assert _advance(views, 0, 2, 1) == (1, 0)
    assert _advance(views, 0, 1, 5) == (2, 1)
    assert _advance(views, 1, 1, 5) == (3, 0)


def test_put_where_a_file_blocks_the_folder(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("f", b"x")
    with pytest.raises(StorageError) as e:
        store.put("f/child", b"y")
    assert not isinstance(e.value, NotFoundError)
    assert "f/child" in str(e.value)


def test_put_racing_deletes_that_prune_folders(tmp_path: Path) -> None:
    # Deleting the last object of a folder removes the folder; writers into that folder at the
    # same moment must recreate it rather than fail.
    store = LocalStore(str(tmp_path))
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for n in range(40):
                store.put(f"a/b/w{i}-{n}", b"x")
                store.delete(f"a/b/w{i}-{n}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list(store.list()) == []


def test_concurrent_put_if_absent_across_store_instances(tmp_path: Path) -> None:
    # Two stores on one root behave like two hosts on a shared filesystem.
    stores = [LocalStore(str(tmp_path)) for _ in range(2)]
    barrier = threading.Barrier(6)
    won: list[bool] = []

    def go(i: int) -> None:
        barrier.wait()
        won.append(stores[i % 2].put_if_absent("commit", str(i).encode()))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1


# -- direct I/O (O_DIRECT) writes of large objects ----------------------------------------------


class CountingPool(BouncePool):
    """A bounce pool that counts its loans: shows that an object went through O_DIRECT."""

    def __init__(self, size: int = DIRECT_BUFFER_BYTES, count: int = 2):
        super().__init__(size, count)
        self.loans = 0

    def lend(self):
        self.loans += 1
        return super().lend()


def _pieces(total: int, seed: int) -> list[bytes]:
    """``total`` random bytes cut at odd places, so bounce-buffer and block boundaries fall
    inside views."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    cuts = sorted({0, total, *rng.integers(0, total, 5).tolist(), min(total, 4093), min(total, 4)})
    return [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)] + [b""]


@pytest.mark.parametrize("size", [DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, 3 * DIRECT_MIN_BYTES + 4095, 5 << 20])
def test_large_objects_go_direct_and_read_back_exactly(tmp_path: Path, size: int) -> None:
    store = LocalStore(str(tmp_path / "root"), direct_io=True)
    store._bounce = pool = CountingPool(size=64 << 10)  # many bounce refills per object
    pieces = _pieces(size, size)
    want = b"".join(pieces)
    store.put("a/put", pieces)
    store.put_deferred("a/deferred", pieces)
    store.sync()
    assert store.put_if_absent("a/once", pieces) is True
    assert pool.loans == 3
    for key in ("a/put", "a/deferred", "a/once"):
        assert os.path.getsize(tmp_path / "root" / key) == size  # the padded last block is cut off
        assert store.get(key) == want
    assert sorted(os.listdir(tmp_path / "root" / "a")) == ["deferred", "once", "put"]


def test_small_objects_and_disabled_direct_io_use_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    store = LocalStore(str(tmp_path / "a"), direct_io=True)
    store._bounce = pool = CountingPool()
    store.put("small", b"x" * (DIRECT_MIN_BYTES - 1))
    assert pool.loans == 0
    monkeypatch.setenv("CKPTD_DIRECT_IO", "0")
    off = LocalStore(str(tmp_path / "b"))
    off._bounce = pool = CountingPool()
    off.put("big", b"y" * (2 * DIRECT_MIN_BYTES))
    assert pool.loans == 0 and off.get("big") == b"y" * (2 * DIRECT_MIN_BYTES)


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path: Path, monkeypatch) -> None:
    """EINVAL from open(O_DIRECT) (a filesystem without direct I/O): the object is written
    buffered, and so are later ones, with nothing left behind."""
    import storage_backends.local as local_mod

    calls = []

    def refuse(path: str, dir_fd: int | None = None) -> int:
        calls.append(path)
        raise DirectUnsupported(errno.EINVAL, "O_DIRECT refused: Invalid argument")

    monkeypatch.setattr(local_mod, "open_direct", refuse)
    store = LocalStore(str(tmp_path), direct_io=True)
    data = os.urandom(2 * DIRECT_MIN_BYTES + 3)
    store.put_deferred("k/one", data)
    store.put("k/two", data)
    store.sync()
    assert len(calls) == 1 and store._direct is False
    assert store.get("k/one") == data and store.get("k/two") == data
    assert sorted(os.listdir(tmp_path / "k")) == ["one", "two"]


def test_a_direct_write_refused_midway_is_rewritten_buffered(tmp_path: Path, monkeypatch) -> None:
    """An aligned direct write that fails with EINVAL after part of the object went out (a
    filesystem with a larger alignment): the temp file is dropped and the object rewritten."""
    import storage_backends.local as local_mod

    def half_then_refuse(fd, views, pool):
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)  # page-aligned: a real direct write
        raise DirectUnsupported(errno.EINVAL, "O_DIRECT write refused: Invalid argument")

    monkeypatch.setattr(local_mod, "write_direct", half_then_refuse)
    store = LocalStore(str(tmp_path), direct_io=True)
    data = os.urandom(DIRECT_MIN_BYTES + 77)
    store.put("k", data)
    assert store._direct is False and store.get("k") == data
    assert os.listdir(tmp_path) == ["k"]


def test_write_direct_pads_and_truncates(tmp_path: Path) -> None:
    pool = BouncePool(8192, 1)
    for size in (0, 1, 4095, 4096, 8192, 8193, 3 * 8192 + 5):
        p = str(tmp_path / f"f{size}")
        views = [memoryview(x) for x in _pieces(size, size)] if size else [memoryview(b"")]
        fd = open_direct(p)
        try:
            assert write_direct(fd, views, pool) == size
        finally:
            os.close(fd)
        with open(p, "rb") as f:
            assert f.read() == b"".join(bytes(v) for v in views)


def test_write_direct_sends_aligned_regions_from_the_source(tmp_path: Path, monkeypatch) -> None:
    """A page-aligned source (an object image) goes to the disk from its own memory; only its
    unaligned tail, and views after it, pass through the bounce buffer. The file is exact."""
    import storage_backends._direct as direct_mod

    sources = []
    real_pwrite = os.pwrite

    def spy(fd, data, pos):  # forwards to the real syscall, noting where the bytes came from
        sources.append((np.frombuffer(data, np.uint8).ctypes.data, len(data), pos))
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(direct_mod.os, "pwrite", spy)
    image = mmap.mmap(-1, 5 * 4096 + 100)  # page-aligned, like a snapshot's object image
    image[:] = os.urandom(len(image))
    base = np.frombuffer(image, np.uint8).ctypes.data
    tail = os.urandom(333)
    pool = BouncePool(8192, 1)
    bounce_addr = []
    with pool.lend() as b:
        bounce_addr.append(np.frombuffer(b, np.uint8).ctypes.data)
    fd = open_direct(str(tmp_path / "f"))
    try:
        assert write_direct(fd, [memoryview(image), memoryview(tail)], pool) == len(image) + len(tail)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == bytes(image) + tail
    assert sources[0] == (base, 5 * 4096, 0)  # straight from the image
    assert all(addr == bounce_addr[0] for addr, _, _ in sources[1:])  # the rest bounced
    assert sum(n for _, n, _ in sources[1:]) == 4096  # 100 + 333 bytes, padded to one block


def test_bounce_pool_bounds_its_buffers() -> None:
    pool = BouncePool(4096, 2)
    seen = set()
    for _ in range(5):
        with pool.lend() as a, pool.lend() as b:
            seen |= {id(a), id(b)}
    assert len(seen) == 2  # reused, never more than two
    with pytest.raises(ValueError, match="multiple of 4096"):
        BouncePool(1000, 1)
