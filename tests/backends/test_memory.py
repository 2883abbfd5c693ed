from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from storage_backends import MemoryStore, NotFoundError, StorageError, open_store
from storage_backends.testing import StoreConformance


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[MemoryStore]:
        with MemoryStore() as s:
            yield s


def test_same_name_shares_data() -> None:
    a, b = open_store("memory://shared"), open_store("memory://shared")
    assert a is not b and a.uri == b.uri == "memory://shared"
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert b.put_if_absent("k", b"w") is False
    with pytest.raises(NotFoundError):
        open_store("memory://other").get("k")


def test_registry_is_thread_safe() -> None:
    # Threads opening the same new name at once must all land in one namespace.
    barrier = threading.Barrier(8)

    def open_and_write(i: int) -> None:
        barrier.wait()
        open_store("memory://racy").put(f"k{i}", b"x")

    threads = [threading.Thread(target=open_and_write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [i.key for i in open_store("memory://racy").list()] == [f"k{i}" for i in range(8)]


def test_anonymous_stores_are_private() -> None:
    a, b = MemoryStore(), MemoryStore()
    a.put("k", b"v")
    assert not b.exists("k")
    assert a.uri != b.uri


def test_memory_uri_needs_a_name() -> None:
    with pytest.raises(StorageError, match="memory://name"):
        open_store("memory://")
