"""The keys of a step folder that belong to the commit protocol (``manifest.is_reserved``): the
commit record, done records and claims. A part's metadata may not name them -- ``persist``
refuses such a part before writing a byte (the daemon's ``handoff.validate`` uses the same
check)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd import manifest as mf
from ckptd import persist
from ckptd.errors import CheckpointError
from ckptd.savejob import SaveJob
from storage_backends import memory


@pytest.mark.parametrize(
    ("key", "reserved"),
    [
        (mf.COMMIT, True),
        (f"{mf.DONE}/a/t1/000000/r000000.0.0.0.json", True),
        (f"{mf.CLAIMS}/000000.json", True),
        (f"{mf.CLAIMS}/a/000000/go.json", True),
        (mf.MANIFEST, False),
        (mf.GROUP, False),
        ("commit.json.bak", False),
        (f"{mf.DONE}x", False),
        (f"{mf.ARRAYS}/w/zarr.json", False),
    ],
)
def test_is_reserved(key, reserved):
    assert mf.is_reserved(key) is reserved


@pytest.mark.parametrize("key", [mf.COMMIT, f"{mf.DONE}/a/x.json", f"{mf.CLAIMS}/000001.json"])
def test_persist_refuses_a_part_whose_metadata_names_a_protocol_key(key):
    store = memory.MemoryStore()
    part = SaveJob(step=1, attempt="a", rank=0, world_size=1, metadata=[(key, b"{}")])
    with ThreadPoolExecutor(2) as pool, pytest.raises(CheckpointError, match="reserved for the commit protocol"):
        persist.persist(store, part, pool, writer="job")
    assert [
        o.key for o in store.list(f"{mf.step_dir(1)}/") if not o.key.startswith(f"{mf.step_dir(1)}/{mf.CLAIMS}/")
    ] == []
