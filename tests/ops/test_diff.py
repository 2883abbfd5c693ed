"""``ckptd diff``: real CLI subprocesses on checkpoints saved by real FSDP ranks at 4 and 3 ranks."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from ckptd import diff as _diff
from ckptd.layout import Box
from tests.distributed import launch

pytestmark = pytest.mark.slow


def ckptd(*args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{launch.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        **kw,
    )


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """root4: step 1 saved by 4 FSDP ranks. root3: the same state saved by 3 ranks at step 1,
    and at step 2 with three known changes (``scenarios.save_fsdp``)."""
    base = tmp_path_factory.mktemp("diff")
    root4, root3 = str(base / "r4"), str(base / "r3")
    launch.run(4, "save_fsdp", base / "out4", scenarios="tests.ops.scenarios", roots=[root4])
    launch.run(3, "save_fsdp", base / "out3", scenarios="tests.ops.scenarios", roots=[root3], changed_at=2)
    return root4, root3


def _shard_rows(root: str, key: str) -> int:
    doc = json.loads(ckptd("show", root, "--step", "1", "--json").stdout)
    return next(t["shard_shape"][0] for t in doc["tensors"] if t["key"] == key)


@pytest.mark.timeout(600)
def test_same_state_across_layouts_is_equal(roots):
    root4, root3 = roots
    # the two sides really are laid out differently
    assert _shard_rows(root4, "model/emb.weight") != _shard_rows(root3, "model/emb.weight")
    r = ckptd("diff", root4, root3, "--step-b", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("EQUAL: ") and "12 equal, 0 different" in r.stdout
    assert r.stderr == ""  # no progress bar into a pipe
    r = ckptd("diff", root4, root3, "--step-b", "1", "--json", "--block-mib", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["equal"] is True and doc["counts"] == {"equal": 12} and doc["state"] == []
    assert {t["key"] for t in doc["tensors"]} >= {"model/fc1.weight", "extra/bf16", "extra/i64"}


@pytest.mark.timeout(600)
def test_differences_are_reported(roots):
    _, root3 = roots
    r = ckptd("diff", root3, root3, "--step-a", "1", "--json")  # step b: the latest (2)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["equal"] is False and doc["a"]["step"] == 1 and doc["b"]["step"] == 2
    big = next(t for t in doc["tensors"] if t["key"] == "extra/big")
    assert big["status"] == "different" and big["different"] == 1
    assert 0.5e-3 < big["max_abs_diff"] < 2e-3 and big["max_ulps"] > 0
    assert doc["only_b"] == ["extra/new"] and doc["only_a"] == []
    assert doc["state"] == [{"path": "meta/data/note", "a": '"a"', "b": '"b"'}]
    assert sum(1 for t in doc["tensors"] if t["status"] == "equal") == 11
    r = ckptd("diff", root3, root3, "--step-a", "1", "--step-b", "2")
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1].startswith("DIFFERENT: ")
    assert "extra/big" in r.stdout and "extra/new" in r.stdout and "state meta/data/note" in r.stdout
    assert "model/fc1.weight" not in r.stdout  # equal rows only with --all
    assert "None" not in r.stdout


@pytest.mark.timeout(300)
def test_bad_usage_and_failures(roots, tmp_path):
    root4, root3 = roots
    for args in ([root4], [root4, root3, "--step-a", "-1"], ["bogus://x", root3], [root4, root3, "--block-mib", "0"]):
        r = ckptd("diff", *args)
        assert r.returncode == 2, (args, r.stderr)
    r = ckptd("diff", root4, root3, "--step-a", "9")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such checkpoint" in r.stderr
    # a corrupt chunk on one side: exit 1 naming it, never "equal"
    bad = tmp_path / "bad"
    shutil.copytree(root4, bad)
    folder = bad / "step_0000000001" / "arrays" / "extra" / "big"
    shard = next(p for p in folder.rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = ckptd("diff", root4, bad)
    assert r.returncode == 1 and "crc32c" in r.stderr and "extra" in r.stderr, r.stderr


@pytest.mark.timeout(300)
def test_progress_only_on_a_terminal(roots):
    root4, root3 = roots
    master, slave = pty.openpty()
    try:
        env = {**os.environ, "PYTHONPATH": f"{launch.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        p = subprocess.run(
            [sys.executable, "-m", "ckptd.cli.main", "diff", root4, root3, "--step-b", "1", "--block-mib", "1"],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
            timeout=240,
        )
        os.close(slave)
        slave = -1
        err = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0
    assert b"comparing [" in err and b"100%" in err


def test_blocks_stay_under_the_budget():
    shape, itemsize, budget = (37, 5, 16), 4, 700
    seen = np.zeros(shape, bool)
    for box in _diff._blocks(shape, itemsize, budget):
        assert box.volume * itemsize <= budget
        idx = tuple(slice(a, b) for a, b in zip(box.start, box.stop, strict=True))
        assert not seen[idx].any()
        seen[idx] = True
    assert seen.all()
    assert list(_diff._blocks((), 4, 8)) == [Box((), ())]


def _td(a, b):
    td = _diff.TensorDiff("k", "equal")
    _diff._compare(td, np.asarray(a), np.asarray(b))
    return td


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_ulps_and_signed_zero(dtype):
    one = np.array([1.0, 0.0, 2.0], dtype)
    nxt = one.copy()
    nxt[0] = np.nextafter(np.float64(1.0), 2.0) if dtype == np.float64 else one[0]
    if dtype != np.float64:
        bits = one.view({2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]).copy()
        bits[0] += 3
        nxt = bits.view(dtype)
    nxt[1] = -0.0
    td = _td(one, nxt)
    assert td.different == 2
    assert td.max_ulps == (1 if dtype == np.float64 else 3)
    assert td.max_abs_diff > 0
    td = _td(np.array([0.0], dtype), np.array([-0.0], dtype))
    assert (td.different, td.max_abs_diff, td.max_ulps) == (1, 0.0, 1)
    td = _td(one, one.copy())
    assert (td.different, td.max_abs_diff, td.max_ulps) == (0, 0.0, 0)


def test_integer_extremes():
    a = np.array([np.iinfo(np.int64).min, 5], np.int64)
    b = np.array([np.iinfo(np.int64).max, 5], np.int64)
    td = _td(a, b)
    assert td.different == 1 and td.max_abs_diff == 2**64 - 1 and td.max_ulps is None
    td = _td(np.array([0, 2**64 - 1], np.uint64), np.array([2**64 - 1, 2**64 - 1], np.uint64))
    assert td.max_abs_diff == 2**64 - 1
    td = _td(np.array([True, False]), np.array([True, True]))
    assert td.different == 1 and td.max_abs_diff == 1
