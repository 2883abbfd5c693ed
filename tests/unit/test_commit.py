"""The commit protocol's pieces on their own: ``try_commit``, ``begin``, retention.

Run on the memory store and on the local filesystem store (real files)."""

from __future__ import annotations

import json

import pytest

from ckptd import catalog, commit
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import memory, open_store


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    if request.param == "memory":
        name = f"commit-{tmp_path.name}"
        memory.reset(name)
        s = open_store(f"memory://{name}")
    else:
        s = open_store(str(tmp_path / "root"))
    yield s
    s.close()


def done(store, step, attempt, rank, nbytes=10, objects=2):
    rec = {"rank": rank, "bytes": nbytes, "objects": objects}
    store.put(mf.done_key(step, attempt, rank), mf.dumps(rec))


def committed_step(store, step, attempt="a0", world_size=1):
    """A minimal committed folder: what retention looks at."""
    store.put(f"{mf.step_dir(step)}/{mf.MANIFEST}", b"{}")
    for r in range(world_size):
        done(store, step, attempt, r)
    assert commit.try_commit(store, step, attempt, world_size)


def test_try_commit_waits_for_every_rank_then_commits_once(store):
    done(store, 3, "att", 0, nbytes=5, objects=1)
    assert not commit.try_commit(store, 3, "att", 2)  # rank 1 has not finished
    assert catalog.read_commit(store, 3) is None
    done(store, 3, "att", 1, nbytes=7, objects=2)
    assert commit.try_commit(store, 3, "att", 2, {"note": "x"})
    rec = catalog.read_commit(store, 3)
    assert (rec["step"], rec["attempt"], rec["world_size"], rec["bytes"], rec["objects"], rec["note"]) == (
        3,
        "att",
        2,
        12,
        3,
        "x",
    )
    # a second finisher (or daemon) racing on the same step does not write it again
    assert not commit.try_commit(store, 3, "att", 2)
    assert json.loads(store.get(f"{mf.step_dir(3)}/{mf.COMMIT}")) == rec


def test_try_commit_ignores_done_records_of_another_attempt(store):
    done(store, 4, "old", 0)
    done(store, 4, "old", 1)
    done(store, 4, "new", 0)
    assert not commit.try_commit(store, 4, "new", 2)
    assert catalog.read_commit(store, 4) is None


def test_begin_refuses_a_committed_step_and_clears_a_stale_partial(store):
    committed_step(store, 1)
    with pytest.raises(CheckpointError, match="already committed"):
        commit.begin(store, 1)
    assert catalog.read_commit(store, 1) is not None
    store.put(f"{mf.step_dir(2)}/arrays/x/c/0", b"stale")
    commit.begin(store, 2)
    assert list(store.list(f"{mf.step_dir(2)}/")) == []


def test_select_for_deletion_keeps_newest_and_never_newer_partials(store):
    for s in (1, 2, 3, 5):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"partial older than the newest commit")
    store.put(f"{mf.step_dir(6)}/arrays/x/c/0", b"partial newer than the newest commit (in flight)")
    assert catalog.select_for_deletion(store, 2) == [1, 2, 4]
    assert catalog.select_for_deletion(store, 2, protect={2}) == [1, 4]
    assert catalog.select_for_deletion(store, 10) == [4]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        catalog.select_for_deletion(store, 0)
    assert catalog.steps(store) == [1, 2, 3, 4, 5, 6]  # selecting deletes nothing


def test_retain_deletes_what_it_selects(store):
    for s in (1, 2, 3):
        committed_step(store, s)
    store.put(f"{mf.step_dir(4)}/arrays/x/c/0", b"in flight")
    assert catalog.retain(store, 1) == [1, 2]
    assert catalog.steps(store) == [3, 4]
    assert catalog.committed_steps(store) == [3]
    assert catalog.retain(store, 1) == []


def test_select_for_deletion_on_a_root_without_commits(store):
    store.put(f"{mf.step_dir(1)}/arrays/x/c/0", b"partial")
    assert catalog.select_for_deletion(store, 1) == []
