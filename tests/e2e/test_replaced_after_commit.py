"""A committed step verifies itself against what its committing attempt wrote (issue 26, part 1).

The attack: after step 2 committed, its shard object is replaced by another attempt's object of
the same layout, validly encoded (every crc32c passes) -- what a slow writer's late PUT does. It
is made here for real: a second job saves the same step into a scratch root with the real
encoder, and its shard object is copied over the committed one. Before pins, ``ckptd verify``
exited 0 and ``restore`` silently returned the other job's values; now the object's crc32c
differs from the pin in the committing attempt's done record: verify exits 1 naming the object,
restore raises ``CorruptChunkError`` and ``restore(fallback=True)`` returns step 1 bitwise.
"""

from __future__ import annotations

import pytest
import torch

from ckptd.cli.main import main
from storage_backends import open_store
from trainer_hooks import Checkpointer, CorruptChunkError

SHAPE = (64, 32)
SHARD = "arrays/w/c/0/0"


def value(step: int, job: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * step + job * 1000


@pytest.fixture(params=["local", "moto", "rgw"])
def roots(request, tmp_path):
    """(the job root, a scratch root for the other job) on one backend."""
    if request.param == "local":
        return str(tmp_path / "job"), str(tmp_path / "other")
    root = request.getfixturevalue("s3_bucket" if request.param == "moto" else "rgw_bucket")
    return root, root.rsplit("/", 1)[0] + "/other"


def test_an_object_replaced_after_the_commit_is_caught(roots, capsys):
    root, other = roots
    with Checkpointer(root) as ck:
        ck.save(1, {"w": value(1, 0)}).result()
        ck.save(2, {"w": value(2, 0)}).result()
    with Checkpointer(other) as ck:  # another job's attempt at the same step, same layout
        ck.save(2, {"w": value(2, 1)}).result()
    store, scratch = open_store(root), open_store(other)
    key = f"step_0000000002/{SHARD}"
    theirs = scratch.get(key)
    assert theirs != store.get(key) and len(theirs) == len(store.get(key))
    store.put(key, theirs)  # the late write lands on the committed step

    rc = main(["verify", root, "--step", "2"])
    out = capsys.readouterr()
    assert rc == 1, out
    assert SHARD in out.out + out.err and "Traceback" not in out.err

    got = {"w": torch.zeros(SHAPE)}
    with Checkpointer(root) as ck:
        with pytest.raises(CorruptChunkError, match=SHARD):
            ck.restore(got, step=2)
        assert torch.equal(got["w"], torch.zeros(SHAPE))  # a failed restore leaves the state as it was
        assert ck.restore(got, fallback=True) == 1
    assert torch.equal(got["w"], value(1, 0))


def test_a_changed_done_record_or_metadata_object_fails_verify(tmp_path):
    """The done records' pins must sum to commit.json's: a done record swapped for one that
    pins the replaced object is caught; so is a zarr.json changed after the commit."""
    import json

    from ckptd import donetree
    from ckptd.verify import verify

    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(2, {"w": value(2, 0)}).result()
    store = open_store(root)
    assert verify(store, 2).ok
    (rec_key,) = [o.key for o in store.list("step_0000000002/_done/") if "/t1/" in o.key]
    rec = json.loads(store.get(rec_key))
    size, *_ = rec["pins"]["shards"][SHARD]
    rec["pins"]["shards"][SHARD] = [size, "AAAAAA=="]
    store.put(rec_key, json.dumps(rec).encode())
    report = verify(store, 2)
    assert not report.ok and "a done record was changed after the commit" in report.errors[0]
    store.delete(rec_key)
    store.put(donetree.record_key(2, rec_key.split("/")[2], 0, rec), json.dumps(rec).encode())
    assert not verify(store, 2).ok  # renamed to match its new content: the sum still differs

    with Checkpointer(str(tmp_path / "two")) as ck:
        ck.save(2, {"w": value(2, 0)}).result()
    two = open_store(str(tmp_path / "two"))
    meta = json.loads(two.get("step_0000000002/arrays/w/zarr.json"))
    meta["attributes"] = {"changed": True}
    two.put("step_0000000002/arrays/w/zarr.json", json.dumps(meta).encode())
    report = verify(two, 2)
    assert not report.ok and any("arrays/w/zarr.json differs" in e for e in report.errors), report.errors
