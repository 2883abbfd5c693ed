"""Checkpointer in one process: what comes back, what is refused, and what is left untouched."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch

from ckptd import catalog, jsonenc
from ckptd.errors import CheckpointError, CheckpointNotFoundError, CorruptChunkError, StateMismatchError
from storage_backends import open_store
from trainer_hooks import Checkpointer


def make(seed=0, hidden=8, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched}


def step(state):
    x = torch.randn(5, 4, dtype=next(state["model"].parameters()).dtype)
    state["model"](x).float().pow(2).mean().backward()
    state["optim"].step()
    state["sched"].step()


def snapshot(state):
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "job")


@pytest.mark.parametrize("optim_cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_any_optimizer_roundtrips(root, optim_cls):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    kw = {"momentum": 0.9} if optim_cls is torch.optim.SGD else {}
    opt = optim_cls(model.parameters(), lr=0.1, **kw)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with Checkpointer(root) as ck:
        ck.save(0, {"model": model, "optim": opt}).result()
        m2 = torch.nn.Linear(4, 3)
        o2 = optim_cls(m2.parameters(), lr=0.5, **kw)
        assert ck.restore({"model": m2, "optim": o2}) == 0
    a, b = opt.state_dict(), o2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, s in a["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["state"][i][k]) if isinstance(v, torch.Tensor) else v == b["state"][i][k]


def test_dtypes_json_values_and_rng(root):
    state = make(dtype=torch.bfloat16)
    step(state)
    extra = {
        "f16": torch.randn(3).half(),
        "i64": torch.arange(5),
        "flag": torch.tensor([True, False]),
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "nested": {"t": torch.ones(2, 2), "tuple": (1, "a"), "bytes": b"\x00\xff", "inf": -math.inf},
    }
    state.update(extra=extra, epoch=3, name="run-1", np_scalar=np.int64(7))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    with Checkpointer(root) as ck:
        ck.save(10, state).result()
        expect = (random.random(), np.random.rand(), torch.rand(1))
        new = make(seed=1, dtype=torch.bfloat16)
        new_extra = {
            "f16": torch.zeros(3).half(),
            "i64": torch.zeros(5, dtype=torch.int64),
            "flag": torch.zeros(2, dtype=torch.bool),
            "zero_d": torch.tensor(0.0),
            "empty": torch.empty(0, 7),
            "nested": {"t": torch.zeros(2, 2)},
        }
        keep = new_extra["nested"]["t"]
        new.update(extra=new_extra, epoch=0, name="", np_scalar=np.int64(0))
        assert ck.restore(new) == 10
    got = (random.random(), np.random.rand(), torch.rand(1))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    for k, v in snapshot(state).items():
        assert torch.equal(v, new["model"].state_dict()[k]) and v.dtype == torch.bfloat16
    for k in ("f16", "i64", "flag", "zero_d", "empty"):
        assert torch.equal(extra[k], new_extra[k]) and extra[k].dtype == new_extra[k].dtype
    assert new_extra["nested"]["t"] is keep and torch.equal(keep, torch.ones(2, 2))  # copied in place
    assert new_extra["nested"]["tuple"] == (1, "a") and new_extra["nested"]["bytes"] == b"\x00\xff"
    assert new_extra["nested"]["inf"] == -math.inf
    assert (new["epoch"], new["name"], new["np_scalar"]) == (3, "run-1", np.int64(7))
    assert new["sched"].state_dict() == state["sched"].state_dict()


def test_no_pickle_in_the_format(root):
    state = make()
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".json"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    json.loads(fh.read())  # all metadata is JSON
            else:
                assert "/arrays/" in dirpath.replace(os.sep, "/") + "/", f  # the rest is zarr chunks


def test_empty_root_restores_nothing(root):
    with Checkpointer(root) as ck:
        assert ck.latest_step() is None
        assert ck.restore(make()) is None


def test_unknown_scheme_is_one_clear_error():
    with pytest.raises(CheckpointError, match="gs"):
        Checkpointer("gs://bucket/x")


def test_mismatches_name_key_and_leave_state_untouched(root):
    state = make()
    step(state)
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
        other = make(seed=3, hidden=9)
        before = snapshot(other)
        with pytest.raises(StateMismatchError, match=r"step_0000000001.*'model/0.weight'.*\(8, 4\).*\(9, 4\)"):
            ck.restore(other)
        assert all(torch.equal(v, snapshot(other)[k]) for k, v in before.items())
        wrong_dtype = make(seed=3, dtype=torch.float64)
        with pytest.raises(StateMismatchError, match=r"'model/0.weight'.*float32.*float64"):
            ck.restore(wrong_dtype)
        more = {**make(seed=3), "extra": torch.zeros(2)}
        with pytest.raises(StateMismatchError, match="'extra' is in the state but not in the checkpoint"):
            ck.restore(more)
        fewer = {"model": make(seed=3, hidden=9)["model"]}
        with pytest.raises(StateMismatchError, match=r"'model/0.weight'.*\(8, 4\).*\(9, 4\)"):
            ck.restore(fewer)  # a subset of the entries, but inside the one given all must match
        fewer = {"model": make(seed=3)["model"]}
        assert ck.restore(fewer) == 1  # a subset of the checkpoint's entries: not an error
        assert torch.equal(fewer["model"][0].weight, state["model"][0].weight)


def flip_a_bit_of_a_chunk(root):
    """Corrupt step 1's first chunk of ``model/2.weight`` on disk: one bit of its data."""
    chunk = os.path.join(root, "step_0000000001", "arrays", "model", "2.weight", "c", "0", "0")
    with open(chunk, "r+b") as f:
        f.seek(3)
        b = f.read(1)
        f.seek(3)
        f.write(bytes([b[0] ^ 1]))


def test_corrupt_chunk_raises_and_leaves_state_untouched(root):
    state = make()
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    flip_a_bit_of_a_chunk(root)
    other = make(seed=9)
    before = snapshot(other)
    with Checkpointer(root) as ck, pytest.raises(CorruptChunkError, match=r"arrays/model/2.weight.*crc32c"):
        ck.restore(other)
    assert all(torch.equal(v, snapshot(other)[k]) for k, v in before.items())


def test_partial_step_is_never_restored(root):
    state = make()
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
        ck.save(2, state).result()
    os.remove(os.path.join(root, "step_0000000002", "commit.json"))
    with Checkpointer(root) as ck:
        assert ck.latest_step() == 1
        with pytest.raises(CheckpointNotFoundError, match="partial"):
            ck.restore(make(), step=2)
        assert ck.restore(make()) == 1
        with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
            ck.restore(make(), step=7)


def test_buffers_are_reused_and_retention_keeps_newest(root):
    state = make()
    with Checkpointer(root, keep_last=2) as ck:
        ck.save(0, state)
        size = ck.staged_bytes
        for s in range(1, 6):
            step(state)
            ck.save(s, state)
            assert ck.staged_bytes == size  # allocated once, reused
            phases = ck.last_save_phases
            assert set(phases) == {"wait_previous", "begin", "flatten", "snapshot", "describe"}
            assert sum(phases.values()) == pytest.approx(ck.last_save_blocked_s, abs=1e-3)
        ck.wait_idle()  # commits and the retention that runs after them
        assert catalog.committed_steps(open_store(root)) == [4, 5]
    assert catalog.committed_steps(open_store(root)) == [4, 5]


def test_refuses_to_overwrite_a_committed_step_and_reports_failures(root):
    state = make()
    with Checkpointer(root) as ck:
        ck.save(3, state).result()
        with pytest.raises(CheckpointError, match="already committed"):
            ck.save(3, state)
        with pytest.raises(CheckpointError, match="step must be"):
            ck.save(-1, state)
        with pytest.raises(CheckpointError, match="cannot store a value of type object"):
            ck.save(4, {"x": object()})


def test_failed_background_save_is_raised_not_lost(tmp_path):
    root = tmp_path / "job"
    state = make()
    ck = Checkpointer(str(root))
    ck.save(1, state).result()
    real_put, real_new = ck.store.put, ck.store.put_new

    def broken_put(key, data):  # an injected fault: the disk is full
        raise OSError(28, "No space left on device")

    ck.store.put = ck.store.put_new = broken_put
    ck.save(2, state)  # the snapshot is taken; persisting fails in the background
    with pytest.raises(CheckpointError, match="earlier save \\(step 2\\) failed"):
        ck.save(3, state)
    ck.store.put, ck.store.put_new = real_put, real_new
    fut = ck.save(3, state)
    fut.result()
    ck.close()
    assert catalog.latest_step(open_store(str(root))) == 3


def test_typed_json_roundtrip():
    value = {"t": (1, (2, 3)), "b": b"x", "n": [math.nan], "d": {1: "a", (2, 3): "b"}, "$x": 1, "dt": torch.float16}
    enc = jsonenc.encode(value)
    json.dumps(enc)
    dec = jsonenc.decode(json.loads(json.dumps(enc)))
    assert dec["t"] == (1, (2, 3)) and dec["b"] == b"x" and math.isnan(dec["n"][0])
    assert dec["d"] == {1: "a", (2, 3): "b"} and dec["$x"] == 1 and dec["dt"] is torch.float16


def frozen_finetune_state():
    torch.manual_seed(0)
    return {"w": {f"frozen{i}": torch.randn(64, 256) for i in range(9)} | {"head": torch.randn(64, 256)}}


def check_incremental(root: str):
    state = frozen_finetune_state()
    with Checkpointer(root, incremental=True, keep_last=1) as ck:
        first = ck.save(1, state).result()
        state["w"]["head"] += 1  # only 10% of the bytes change
        second = ck.save(2, state).result()
        assert second.bytes_written <= 0.15 * first.bytes_written, (first, second)
        state["w"]["head"] += 1
        ck.save(3, state).result()  # step 1 and 2 are gone now (keep_last=1): 3 must stand alone
        got = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}}
        assert ck.restore(got) == 3
    assert all(torch.equal(state["w"][k], got["w"][k]) for k in state["w"])
    from ckptd.verify import verify

    store = open_store(root)
    assert catalog.committed_steps(store) == [3]
    assert verify(store, 3).ok


def test_incremental_saves_skip_unchanged_shards(root):
    check_incremental(root)


@pytest.mark.s3
def test_incremental_saves_on_s3_use_server_side_copies(s3_bucket):
    check_incremental(s3_bucket)


def test_in_place_restore_reads_into_the_state_tensors(root):
    """``in_place=True``: the same values as a default restore, read into the model's and the
    optimizer's own storage (no second copy); mismatches are still refused before any read."""
    state = make()
    step(state)
    step(state)
    with Checkpointer(root) as ck:
        ck.save(2, state).result()
        other = make(seed=5)
        step(other)
        ptrs = {k: v.data_ptr() for k, v in other["model"].state_dict().items()}
        exp_ptrs = {id(p): s["exp_avg"].data_ptr() for p, s in other["optim"].state.items()}
        assert ck.restore(other, in_place=True) == 2
        for k, v in other["model"].state_dict().items():
            assert torch.equal(v, state["model"].state_dict()[k])
            assert v.data_ptr() == ptrs[k]  # the same storage, overwritten
        assert {id(p): s["exp_avg"].data_ptr() for p, s in other["optim"].state.items()} == exp_ptrs
        a, b = state["optim"].state_dict(), other["optim"].state_dict()
        assert a["param_groups"] == b["param_groups"]
        for i, s in a["state"].items():
            for k, v in s.items():
                assert torch.equal(v, b["state"][i][k])
        assert other["sched"].state_dict() == state["sched"].state_dict()
        for s_ in (state, other):  # training goes on identically from the restored state
            torch.manual_seed(123)
            s_["optim"].zero_grad()  # gradients are not state
            step(s_)
        assert all(torch.equal(v, snapshot(state)[k]) for k, v in snapshot(other).items())
        wrong = make(seed=3, hidden=9)
        before = snapshot(wrong)
        with pytest.raises(StateMismatchError, match=r"'model/0.weight'.*\(8, 4\).*\(9, 4\)"):
            ck.restore(wrong, in_place=True)
        assert all(torch.equal(v, snapshot(wrong)[k]) for k, v in before.items())


def test_in_place_restore_of_a_corrupt_chunk_says_the_state_may_be_overwritten(root):
    state = make()
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    flip_a_bit_of_a_chunk(root)
    with Checkpointer(root) as ck, pytest.raises(CorruptChunkError, match=r"crc32c.*in_place=True.*partly overwritten"):
        ck.restore(make(seed=9), in_place=True)
