"""The conformance suite every Store runs (as zarr-python's ``zarr.testing.store``).

Subclass ``StoreConformance`` in a test module and provide a ``store`` fixture that yields an
empty store of your backend (and closes it afterwards)::

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            with MyStore(...) as s:
                yield s

A backend that splits large objects into parts should lower its part size in that fixture so
that ``large_size`` spans several parts. Sizes are kept small: the suite runs on every backend
on small CI machines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

from storage_backends.base import ExistsError, InvalidKeyError, NotFoundError, ObjectInfo, StorageError, Store

__all__ = ["FilesystemConformance", "INVALID_KEYS", "StoreConformance", "assert_empty_store"]

MiB = 1 << 20

INVALID_KEYS = ["", "/abs", "../x", "a/../b", "a//b", "a/./b", "./a", "a/", ".", "..", "a\\b", "a\x00b"]


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _run_threads(n: int, fn: Callable[[int], object]) -> list[object]:
    """``fn(i)`` for i in range(n) in n threads released together; returns results or raises."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def assert_empty_store(store: Store) -> None:
    """A store whose root does not exist yet (no folder, no bucket) reads as empty: no root,
    nothing listed, ``get`` raises NotFoundError and ``delete`` does nothing."""
    assert not store.exists_root()
    assert list(store.list()) == []
    assert store.list_dir() == ([], [])
    with pytest.raises(NotFoundError):
        store.get("k")
    store.delete("k")


class StoreConformance:
    """The behaviour ``storage_backends.base.Store`` promises, as tests."""

    # Spans several parts once the fixture lowers the part size to 5 MiB; odd on purpose.
    large_size: int = 12 * MiB + 12345

    # -- get / put --------------------------------------------------------------------------------

    def test_put_get_bytes_like(self, store: Store) -> None:
        for i, data in enumerate([b"hello", bytearray(b"world"), memoryview(b"view!")]):
            store.put(f"k{i}", data)
            got = store.get(f"k{i}")
            assert type(got) is bytes
            assert got == bytes(data)

    def test_put_buffer_list(self, store: Store) -> None:
        f32 = np.arange(100, dtype=np.float32)
        grid = np.arange(24, dtype=np.int16).reshape(4, 6)
        fortran = np.asfortranarray(grid)
        parts = [b"head", bytearray(b"-"), memoryview(f32), memoryview(grid), b"", memoryview(fortran)]
        store.put("a/list", parts)
        expected = b"head-" + f32.tobytes() + grid.tobytes() + fortran.tobytes()
        assert store.get("a/list") == expected
        assert store.head("a/list").size == len(expected)

    def test_put_deferred_then_sync(self, store: Store) -> None:
        # Visible at once (atomic), durable after sync; a durable put may follow into a folder
        # that only a deferred put created.
        store.put_deferred("d/e/f", [b"abc", memoryview(b"def")])
        assert store.get("d/e/f") == b"abcdef"
        store.put("d/e/g", b"x")
        store.sync()
        store.put_deferred("d/e/f", b"new")
        store.sync()
        assert store.get("d/e/f") == b"new" and store.get("d/e/g") == b"x"
        assert [i.key for i in store.list("d/")] == ["d/e/f", "d/e/g"]

    def test_put_new_is_create_only(self, store: Store) -> None:
        # put_new creates, never replaces: a second writer of the key gets ExistsError and the
        # first object stays (also a large one, which a backend may upload in parts).
        big = _payload(self.large_size, 7)
        store.put_new("n/a", [b"first", memoryview(b"!")])
        store.put_new("n/big", big)
        for key, data in (("n/a", b"second"), ("n/big", b"x" * 10)):
            with pytest.raises(ExistsError):
                store.put_new(key, data)
        store.put("n/c", b"by put")
        with pytest.raises(ExistsError):
            store.put_new("n/c", b"late")
        store.sync()
        assert store.get("n/a") == b"first!" and store.get("n/big") == big and store.get("n/c") == b"by put"
        assert [i.key for i in store.list("n/")] == ["n/a", "n/big", "n/c"]

    def test_put_new_races_have_one_winner(self, store: Store) -> None:
        def attempt(i: int) -> bool:
            try:
                store.put_new("race/new", f"writer {i}".encode())
            except ExistsError:
                return False
            return True

        assert sum(_run_threads(8, attempt)) == 1

    def test_delete_if_removes_only_its_own_object(self, store: Store) -> None:
        tag = store.put_new("di/k", b"mine")
        store.sync()
        assert store.delete_if("di/k", tag) is True
        assert not store.exists("di/k")
        assert store.delete_if("di/k", tag) is False  # gone: nothing to do
        # The key was taken again by another writer: a late cleanup with the old tag keeps it.
        old = store.put_new("di/j", b"old writer")
        store.delete("di/j")
        store.put_new("di/j", b"new writer")
        assert store.delete_if("di/j", old) is False
        assert store.get("di/j") == b"new writer"
        assert store.delete_if("di/j", None) is False  # no identity: never by key alone
        assert store.get("di/j") == b"new writer"

    def test_put_copies_caller_buffer(self, store: Store) -> None:
        buf = bytearray(b"original")
        store.put("k", buf)
        buf[:] = b"changed!"
        assert store.get("k") == b"original"

    def test_overwrite(self, store: Store) -> None:
        store.put("k", b"first version")
        store.put("k", b"second")
        assert store.get("k") == b"second"
        assert store.head("k").size == 6

    def test_missing_key(self, store: Store) -> None:
        with pytest.raises(NotFoundError) as e:
            store.get("no/such/key")
        assert "no/such/key" in str(e.value)
        assert isinstance(e.value, KeyError)
        for call in (
            lambda: store.get_range("no/such/key", 0, 1),
            lambda: store.get_range_into("no/such/key", 0, [bytearray(1)]),
            lambda: store.head("no/such/key"),
        ):
            with pytest.raises(NotFoundError):
                call()
        assert not store.exists("no/such/key")

    def test_folder_is_not_an_object(self, store: Store) -> None:
        store.put("dir/file", b"x")
        with pytest.raises(NotFoundError):
            store.get("dir")
        assert not store.exists("dir")

    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.head("empty").size == 0
        assert store.get_range("empty", 0, 0) == b""
        with pytest.raises(StorageError):
            store.get_range("empty", 0, 1)
        assert [(i.key, i.size) for i in store.list()] == [("empty", 0)]
        store.put("empty2", [])
        assert store.get("empty2") == b""

    # -- ranges -----------------------------------------------------------------------------------

    def test_get_range(self, store: Store) -> None:
        data = bytes(range(100))
        store.put("r", data)
        for start, length in [(0, 10), (37, 21), (90, 10), (0, 100), (-16, 16), (-16, 4), (-100, 100), (100, 0)]:
            assert store.get_range("r", start, length) == data[start:][:length]
        assert type(store.get_range("r", 1, 2)) is bytes

    @pytest.mark.parametrize("start,length", [(95, 10), (100, 1), (1000, 5), (-101, 1), (-10, 11)])
    def test_get_range_outside(self, store: Store, start: int, length: int) -> None:
        store.put("r", bytes(100))
        with pytest.raises(StorageError) as e:
            store.get_range("r", start, length)
        assert not isinstance(e.value, NotFoundError)

    def test_get_ranges(self, store: Store) -> None:
        data = _payload(5000)
        store.put("r", data)
        ranges = [(4000, 1000), (0, 1), (-10, 10), (123, 456), (2500, 0)]
        got = store.get_ranges("r", ranges)
        assert got == [data[s:][:n] for s, n in ranges]
        assert store.get_ranges("r", []) == []
        with pytest.raises(StorageError):
            store.get_ranges("r", [(0, 10), (4999, 2)])

    def test_get_range_into(self, store: Store) -> None:
        data = _payload(4096, seed=1)
        store.put("r", data)
        a = np.zeros(100, dtype=np.uint8)
        b = np.zeros(25, dtype=np.float32)  # 100 bytes
        c = bytearray(56)
        store.get_range_into("r", 1000, [memoryview(a), memoryview(b), c])
        assert a.tobytes() + b.tobytes() + bytes(c) == data[1000:1256]
        tail = bytearray(16)
        store.get_range_into("r", -16, [tail])
        assert bytes(tail) == data[-16:]
        store.get_range_into("r", 0, [])  # nothing to read is fine
        with pytest.raises(StorageError):
            store.get_range_into("r", 4090, [bytearray(10)])
        with pytest.raises(ValueError):
            store.get_range_into("r", 0, [memoryview(b"read-only")])

    # -- put_if_absent ----------------------------------------------------------------------------

    def test_put_if_absent(self, store: Store) -> None:
        assert store.put_if_absent("commit", b"first") is True
        assert store.put_if_absent("commit", b"second") is False
        assert store.get("commit") == b"first"
        assert store.put_if_absent("other/commit", [b"a", memoryview(b"b")]) is True
        assert store.get("other/commit") == b"ab"

    def test_put_if_absent_concurrent(self, store: Store) -> None:
        won = _run_threads(8, lambda i: store.put_if_absent("race/commit", f"writer {i}".encode() * 100))
        assert won.count(True) == 1, won
        assert won.count(False) == 7
        winner = won.index(True)
        assert store.get("race/commit") == f"writer {winner}".encode() * 100
        assert [i.key for i in store.list()] == ["race/commit"]  # no temp objects left behind

    # -- concurrency ------------------------------------------------------------------------------

    def test_concurrent_put_get_never_torn(self, store: Store) -> None:
        versions = [bytes([v]) * 3000 for v in range(4)]
        store.put("hot", versions[0])

        def work(i: int) -> None:
            for n in range(12):
                if i < 2:
                    store.put("hot", versions[(i * 12 + n) % 4])
                else:
                    assert store.get("hot") in versions

        _run_threads(4, work)
        assert store.get("hot") in versions

    # -- delete -----------------------------------------------------------------------------------

    def test_delete(self, store: Store) -> None:
        store.put("a/b/c", b"x")
        store.put("a/keep", b"y")
        store.delete("a/b/c")
        assert not store.exists("a/b/c")
        store.delete("a/b/c")  # idempotent
        store.delete("never/existed")
        assert store.get("a/keep") == b"y"
        assert store.list_dir("a/") == (["keep"], [])

    def test_delete_prefix(self, store: Store) -> None:
        for k in ["ckpt/1/a", "ckpt/1/b/c", "ckpt/10/a", "ckpt/2/a", "top"]:
            store.put(k, b"x")
        assert store.delete_prefix("ckpt/1/") == 2
        assert [i.key for i in store.list()] == ["ckpt/10/a", "ckpt/2/a", "top"]
        assert store.delete_prefix("ckpt/1") == 1  # a plain string prefix: matches ckpt/10
        assert store.delete_prefix("nothing/") == 0
        assert store.delete_prefix("") == 2
        assert list(store.list()) == []

    def test_purge_counts_what_it_removed(self, store: Store) -> None:
        for k, n in [("ckpt/1/a", 3), ("ckpt/1/b/c", 5), ("ckpt/10/a", 7)]:
            store.put(k, b"x" * n)
        assert store.purge("ckpt/1/") == (2, 8)
        assert [i.key for i in store.list()] == ["ckpt/10/a"]
        assert store.list_dir("ckpt/") == ([], ["10"])
        assert store.purge("ckpt/1/") == (0, 0)

    # -- listing ----------------------------------------------------------------------------------

    def test_list(self, store: Store) -> None:
        assert list(store.list()) == []
        keys = {"a/b/c": 3, "a/b.d": 1, "a.c": 4, "a/bc": 2, "b": 0, "a/b/e/f": 5, "z/y": 7}
        for k, n in keys.items():
            store.put(k, b"x" * n)
        infos = list(store.list())
        assert all(isinstance(i, ObjectInfo) for i in infos)
        assert [i.key for i in infos] == sorted(keys)
        assert {i.key: i.size for i in infos} == keys
        assert all(i.mtime > 0 for i in infos)
        assert [i.key for i in store.list("a/")] == ["a/b.d", "a/b/c", "a/b/e/f", "a/bc"]
        assert [i.key for i in store.list("a/b")] == ["a/b.d", "a/b/c", "a/b/e/f", "a/bc"]
        assert [i.key for i in store.list("a/b/")] == ["a/b/c", "a/b/e/f"]
        assert [i.key for i in store.list("a")] == ["a.c", "a/b.d", "a/b/c", "a/b/e/f", "a/bc"]
        assert list(store.list("missing/")) == []
        assert [i.key for i in store.list("b")] == ["b"]

    def test_list_dir(self, store: Store) -> None:
        assert store.list_dir() == ([], [])
        for k in ["ckpt/step-1/commit", "ckpt/step-1/data/0", "ckpt/step-2/data/0", "ckpt/index", "top"]:
            store.put(k, b"x")
        assert store.list_dir("") == (["top"], ["ckpt"])
        assert store.list_dir("ckpt/") == (["index"], ["step-1", "step-2"])
        assert store.list_dir("ckpt") == (["index"], ["step-1", "step-2"])  # "/" added
        assert store.list_dir("ckpt/step-1/") == (["commit"], ["data"])
        assert store.list_dir("missing/") == ([], [])

    def test_list_dir_after(self, store: Store) -> None:
        """What ``list_dir`` gives, less what sorts at or before ``after``: the latest-step
        reader trusts it to see every step folder after its start."""
        for k in ["r/step_01/a", "r/step_02/a", "r/step_02/b/c", "r/step_10/a", "r/step_2", "r/z/a", "r/_l/x"]:
            store.put(k, b"x")
        assert store.list_dir_after("r/", "step_02") == (["step_2"], ["step_10", "z"])
        assert store.list_dir_after("r", "step_01") == (["step_2"], ["step_02", "step_10", "z"])
        assert store.list_dir_after("r/", "") == store.list_dir("r/")
        assert store.list_dir_after("r/", "zz") == ([], [])
        assert store.list_dir_after("missing/", "a") == ([], [])

    def test_get_limit(self, store: Store) -> None:
        """``get(key, limit=)`` refuses a larger object (before reading it) and returns one at
        the limit: metadata readers rely on it against huge or endless objects."""
        data = _payload(1000)
        store.put("lim/obj", data)
        assert store.get("lim/obj", limit=1000) == data
        with pytest.raises(StorageError):
            store.get("lim/obj", limit=999)
        with pytest.raises(NotFoundError):
            store.get("lim/missing", limit=10)
        store.put("lim/empty", b"")
        assert store.get("lim/empty", limit=0) == b""

    def test_head_exists(self, store: Store) -> None:
        store.put("h/k", b"12345")
        info = store.head("h/k")
        assert (info.key, info.size) == ("h/k", 5)
        assert info.mtime > 0
        assert store.exists("h/k")
        assert not store.exists("h/k2")
        assert not store.exists("h")

    def test_copy(self, store: Store) -> None:
        store.put("src", b"payload")
        store.copy("src", "dst/copy")
        assert store.get("dst/copy") == b"payload"
        store.put("src", b"changed")  # a copy is independent of its source
        assert store.get("dst/copy") == b"payload"
        store.copy("src", "dst/copy")  # overwrites
        assert store.get("dst/copy") == b"changed"
        with pytest.raises(NotFoundError):
            store.copy("missing", "dst/x")
        assert not store.exists("dst/x")

    # -- keys -------------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_rejected(self, store: Store, key: str) -> None:
        calls: list[Callable[[], object]] = [
            lambda: store.get(key),
            lambda: store.get_range(key, 0, 1),
            lambda: store.get_ranges(key, [(0, 1)]),
            lambda: store.get_range_into(key, 0, [bytearray(1)]),
            lambda: store.put(key, b"x"),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.delete(key),
            lambda: store.head(key),
            lambda: store.copy(key, "ok"),
            lambda: store.copy("ok", key),
        ]
        store.put("ok", b"x")
        for call in calls:
            with pytest.raises(InvalidKeyError):
                call()
        assert [i.key for i in store.list()] == ["ok"]

    @pytest.mark.parametrize("prefix", ["../", "/abs/", "a//b/", "a/../"])
    def test_invalid_prefix_rejected(self, store: Store, prefix: str) -> None:
        for call in (store.list, store.list_dir, store.delete_prefix):
            with pytest.raises(InvalidKeyError):
                call(prefix)

    def test_unusual_but_valid_keys(self, store: Store) -> None:
        keys = ["with space", "ünïcode/ключ", "dots.in.name", "-dash", "zarr.json", "c/0/1.2"]
        for k in keys:
            store.put(k, k.encode())
        assert [i.key for i in store.list()] == sorted(keys)
        for k in keys:
            assert store.get(k) == k.encode()

    # -- large objects ----------------------------------------------------------------------------

    def test_large_object(self, store: Store) -> None:
        n = self.large_size
        data = np.frombuffer(_payload(n, seed=2), dtype=np.uint8)
        # Uneven pieces so that part boundaries fall inside buffers.
        cuts = [0, 3, 1 * MiB + 7, 5 * MiB - 1, 9 * MiB + 11, n]
        store.put("big", [memoryview(data[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])
        assert store.head("big").size == n
        assert store.get("big") == data.tobytes()
        mid, span = 5 * MiB - 100, 2 * MiB  # crosses a 5 MiB part boundary
        assert store.get_range("big", mid, span) == data[mid : mid + span].tobytes()
        assert store.get_range("big", 0, n) == data.tobytes()
        assert store.get_ranges("big", [(mid, 200), (-50, 50)]) == [
            data[mid : mid + 200].tobytes(),
            data[-50:].tobytes(),
        ]
        out = [np.empty(7 * MiB, dtype=np.uint8), np.empty(n - 7 * MiB - 1, dtype=np.uint8)]
        store.get_range_into("big", 1, [memoryview(o) for o in out])
        assert np.array_equal(np.concatenate(out), data[1:])
        assert store.put_if_absent("big", b"small") is False
        assert store.get_range("big", -3, 3) == data[-3:].tobytes()

    def test_uri_and_repr(self, store: Store) -> None:
        assert isinstance(store.uri, str) and store.uri
        assert repr(store) == f"{type(store).__name__}({store.uri!r})"


class FilesystemConformance:
    """Extra cases for stores over a filesystem (``store.root`` is the folder): nothing below the
    root is followed through a symbolic link, and only regular files are objects. Mix it into a
    filesystem backend's test class next to ``StoreConformance``; the fixtures ``store`` and
    ``tmp_path`` must be available. The data outside the root is checked with raw access."""

    @pytest.fixture
    def outside(self, tmp_path):
        out = tmp_path / "outside-the-root"
        (out / "sub").mkdir(parents=True)
        (out / "obj").write_bytes(b"outside")
        (out / "sub" / "deep").write_bytes(b"outside deep")
        (out / "sub" / ".deep.tmp.1.2.ab").write_bytes(b"looks like a temp file")  # purge must not touch
        (out / "empty").mkdir()
        return out

    @staticmethod
    def _outside_intact(outside) -> None:
        assert sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*")) == [
            "empty",
            "obj",
            "sub",
            "sub/.deep.tmp.1.2.ab",
            "sub/deep",
        ]
        assert (outside / "obj").read_bytes() == b"outside"
        assert (outside / "sub" / "deep").read_bytes() == b"outside deep"

    def test_linked_folder_is_not_followed(self, store: Store, outside) -> None:
        store.put("real/x", b"1")
        os.symlink(outside, os.path.join(store.root, "link"))  # type: ignore[attr-defined]
        assert [i.key for i in store.list("")] == ["real/x"]
        assert store.list_dir("") == ([], ["real"])
        assert store.list_dir("link/") == ([], [])
        for key in ("link/obj", "link/sub/deep"):
            for read in (store.get, lambda k: store.get_range(k, 0, 1)):
                with pytest.raises(NotFoundError):
                    read(key)
            assert not store.exists(key)
        for write in (
            lambda: store.put("link/obj", b"overwritten"),
            lambda: store.put("link/new", b"new"),
            lambda: store.put_deferred("link/sub/new", b"new"),
            lambda: store.put_if_absent("link/new2", b"new"),
            lambda: store.copy("real/x", "link/new3"),
        ):
            with pytest.raises(StorageError):
                write()
        store.delete("link/obj")
        store.delete("link/sub/deep")
        assert store.delete_prefix("link/") == 0
        os.symlink(outside, os.path.join(store.root, "real", "inner-link"))  # type: ignore[attr-defined]
        if hasattr(store, "purge"):  # a purge of leftovers never enters a link either
            assert store.purge("link/") == (0, 0)
            assert store.purge("real/inner") == (0, 0)
        assert store.delete_prefix("") == 1  # real/x only
        self._outside_intact(outside)

    def test_linked_file_is_not_an_object(self, store: Store, outside) -> None:
        store.put("d/real", b"1")
        os.symlink(outside / "obj", os.path.join(store.root, "d", "alias"))  # type: ignore[attr-defined]
        assert [i.key for i in store.list("d/")] == ["d/real"]
        assert store.list_dir("d/") == (["real"], [])
        with pytest.raises(NotFoundError):
            store.get("d/alias")
        with pytest.raises(NotFoundError):
            store.copy("d/alias", "d/copy")
        assert store.put_if_absent("d/alias", b"x") is False  # the name is taken; the target untouched
        store.put("d/alias", b"replaced")  # replaces the link itself, atomically
        assert store.get("d/alias") == b"replaced"
        self._outside_intact(outside)

    def test_special_files_are_not_objects(self, store: Store) -> None:
        store.put("s/real", b"1")
        os.mkfifo(os.path.join(store.root, "s", "fifo"))  # type: ignore[attr-defined]
        os.symlink("/dev/zero", os.path.join(store.root, "s", "zero"))  # type: ignore[attr-defined]
        for key in ("s/fifo", "s/zero"):
            for read in (store.get, lambda k: store.get_range_into(k, 0, [bytearray(8)])):
                with pytest.raises(NotFoundError):  # at once: neither blocks nor reads forever
                    read(key)
            assert not store.exists(key)
        assert [i.key for i in store.list("s/")] == ["s/real"]
