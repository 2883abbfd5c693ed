"""Retention (``ckptd.retention``): what ``select_for_deletion`` selects and ``retain`` deletes."""

from __future__ import annotations

import pytest

from ckptd import catalog, retention
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from tests.protocol.parts import committed_step


def test_select_for_deletion_keeps_newest_and_never_newer_partials(store):
    for s in (1, 2, 3, 5):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"partial older than the newest commit")
    store.put(f"{mf.step_dir(6)}/arrays/x/c/0", b"partial newer than the newest commit (in flight)")
    assert retention.select_for_deletion(store, 2) == [1, 2, 4]
    assert retention.select_for_deletion(store, 2, protect={2}) == [1, 4]
    assert retention.select_for_deletion(store, 10) == [4]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        retention.select_for_deletion(store, 0)
    assert catalog.steps(store) == [1, 2, 3, 4, 5, 6]  # selecting deletes nothing


def test_retain_deletes_what_it_selects(store):
    for s in (1, 2, 3):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"in flight")
    assert retention.retain(store, 1) == [1, 2]
    assert catalog.steps(store) == [3, 4]
    assert catalog.committed_steps(store) == [3]
    assert retention.retain(store, 1) == []


def test_select_for_deletion_on_a_root_without_commits(store):
    store.put(f"{mf.step_dir(1)}/arrays/x/c/0", b"partial")
    assert retention.select_for_deletion(store, 1) == []
