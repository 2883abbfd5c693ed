from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from storage_backends import LocalStore, NotFoundError, StorageError
from storage_backends.local import _advance
from storage_backends.testing import StoreConformance, assert_empty_store


class TestLocalStore(StoreConformance):
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
