"""open_store: from a job root URI to a store."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage_backends import (
    LocalStore,
    MemoryStore,
    StorageError,
    UnknownSchemeError,
    open_store,
    register_scheme,
    registry,
)


def test_open_store_uris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_store(str(tmp_path)).uri == str(tmp_path)
    assert open_store(f"file://{tmp_path}/x").uri == str(tmp_path / "x")
    assert open_store(f"file://localhost{tmp_path}").uri == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    rel = open_store("relative/root")
    assert isinstance(rel, LocalStore) and rel.uri == str(tmp_path / "relative" / "root")
    with pytest.raises(StorageError, match="host"):
        open_store("file://somehost/x")


def test_unknown_scheme() -> None:
    with pytest.raises(UnknownSchemeError) as e:
        open_store("gs://bucket/prefix")
    msg = str(e.value)
    assert "'gs'" in msg and "s3://" in msg and "file://" in msg and "memory://" in msg
    assert "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_register_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_factories", dict(registry._factories))  # undone after the test
    register_scheme("ckpttest", lambda uri: LocalStore(str(tmp_path / uri.split("://", 1)[1])))
    store = open_store("ckpttest://sub")
    assert isinstance(store, LocalStore) and store.uri == str(tmp_path / "sub")
    assert "ckpttest" in registry.supported_schemes()
    with pytest.raises(ValueError):
        register_scheme("not a scheme", LocalStore)


def test_memory_and_s3_uris() -> None:
    store = open_store("memory://job")
    assert isinstance(store, MemoryStore) and store.uri == "memory://job"
    for bad in ["memory://", "s3://", "s3:///prefix"]:
        with pytest.raises(StorageError):
            open_store(bad)
