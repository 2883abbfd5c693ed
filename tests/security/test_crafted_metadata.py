"""Items 8 (JSON size caps), 9 (absurd layouts), 11 (dangling tensor references) and 12 (one
clean error for hostile JSON) against real checkpoints edited as an attacker with write access
to the bucket (or the shared folder) would, read back by the real CLI and ``restore``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import pytest
import torch

from ckptd.errors import CheckpointError
from tests.security.conftest import assert_one_line_error, cli, make_root, small_state
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(240)

STEP = "step_0000000001"


def _edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))
    if path.name == "manifest.json":  # an attacker who can write the bucket re-pins it in commit.json
        commit = path.parent / "commit.json"
        c = json.loads(commit.read_text())
        c["manifest_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        commit.write_text(json.dumps(c))


def _restore(root, state=None, **kw):
    ckpt = Checkpointer(str(root))
    try:
        return ckpt.restore(state if state is not None else small_state(9), **kw)
    finally:
        ckpt.close()


@pytest.fixture
def root(tmp_path):
    return make_root(tmp_path / "job", steps=(1,))


def test_one_by_one_chunks_on_a_2mib_tensor_are_refused_before_reading(tmp_path):
    root = tmp_path / "job"
    ckpt = Checkpointer(str(root))
    try:
        ckpt.save(1, {"model": {"w": torch.randn(512, 1024)}}).result()
    finally:
        ckpt.close()

    def one_by_one(d):
        for t in d["tensors"]:
            t["shard_shape"] = t["chunk_shape"] = [1, 1]

    _edit(root / STEP / "manifest.json", one_by_one)
    for argv in (("show", root), ("verify", root), ("export", root, "--format", "torch", tmp_path / "o.pt")):
        line = assert_one_line_error(cli(*argv, limit_mb=1024), rc=(1,))
        assert "chunks" in line and "refusing" in line, line
    with pytest.raises(CheckpointError, match="refusing"):
        _restore(root, {"model": {"w": torch.zeros(512, 1024)}})


def test_10_to_the_12_elements_are_refused(root):
    def huge(d):
        d["tensors"][0].update(shape=[10**6, 10**6], shard_shape=[10**6, 10**6], chunk_shape=[1000, 1000])

    _edit(root / STEP / "manifest.json", huge)
    for argv in (("show", root), ("verify", root), ("reshard", root, "--to", 2)):
        line = assert_one_line_error(cli(*argv, limit_mb=1024), rc=(1,))
        assert "more than" in line, line
    with pytest.raises(CheckpointError):
        _restore(root)


def test_dangling_tensor_reference_fails_a_strict_restore(root):
    def dangle(d):
        d["state"]["model"]["data"]["ghost"] = {"$tensor": "model/ghost"}

    _edit(root / STEP / "manifest.json", dangle)
    with pytest.raises(CheckpointError, match="model/ghost"):
        _restore(root)


def test_oversized_json_objects_are_refused_before_reading(root):
    # A sparse 300 MiB manifest: over the cap, refused by its size (reading it would need 300 MiB).
    with open(root / STEP / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)
    line = assert_one_line_error(cli("show", root, limit_mb=400), rc=(1,))
    assert "more than" in line
    with open(root / STEP / "commit.json", "r+b") as f:
        f.truncate(20 << 20)
    p = cli("ls", root, limit_mb=400)
    assert "Traceback" not in p.stderr and p.returncode in (0, 1), p.stderr


DEEP = "[" * 200_000 + "]" * 200_000


def _meta(value):
    """A mutation putting ``value`` as the typed-JSON payload of the ``meta`` state entry."""
    return lambda d: {**d, "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": value}}}}


MANIFEST_MUTATIONS = {
    "deep": lambda d: DEEP,
    "not an object": lambda d: [],
    "step is a string": lambda d: {**d, "step": "1"},
    "huge step": lambda d: {**d, "step": 10**400},
    "world size inf": lambda d: {**d, "world_size": 1e400},
    "tensors an object": lambda d: {**d, "tensors": {"a": 1}},
    "tensor a number": lambda d: {**d, "tensors": [1]},
    "shape of strings": lambda d: {**d, "tensors": [{**d["tensors"][0], "shape": ["16", "8"]}]},
    "shape of floats": lambda d: {**d, "tensors": [{**d["tensors"][0], "shape": [16.0, 8]}]},
    "negative shape": lambda d: {**d, "tensors": [{**d["tensors"][0], "shape": [-16, 8]}]},
    "zero chunk": lambda d: {**d, "tensors": [{**d["tensors"][0], "chunk_shape": [0, 8]}]},
    "unknown dtype": lambda d: {**d, "tensors": [{**d["tensors"][0], "dtype": "object"}]},
    "dtype a list": lambda d: {**d, "tensors": [{**d["tensors"][0], "dtype": ["float32"]}]},
    "state a list": lambda d: {**d, "state": []},
    "state node a string": lambda d: {**d, "state": {"model": "x"}},
    "state data a list": lambda d: {**d, "state": {**d["state"], "model": {"kind": "dict", "data": [1]}}},
    "deep state": lambda d: {
        **d,
        "state": {**d["state"], "meta": {"kind": "dict", "data": json.loads("[" * 500 + "]" * 500)}},
    },
    "bad typed json": lambda d: {
        **d,
        "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$np": ["object", 1]}}}},
    },
    "bad bytes": lambda d: {**d, "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$bytes": 5}}}}},
    "bad ndarray": lambda d: {
        **d,
        "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$ndarray": ["<f4", [10**9], "AAAA"]}}}},
    },
    "bad tuple": lambda d: {**d, "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$tuple": 7}}}}},
    "bad dict": lambda d: {**d, "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$dict": [[1]]}}}}},
    "bad float": lambda d: {**d, "state": {**d["state"], "meta": {"kind": "dict", "data": {"x": {"$float": "nope"}}}}},
}


def _main(capsys, *argv) -> int:
    """The CLI in this process (fast): an exception escaping ``main`` fails the test as a
    traceback would; a failure must be one ``ckptd: error:`` line, exit 1."""
    from ckptd.cli.main import main

    rc = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert rc in (0, 1), (argv, rc, err)
    if rc:
        lines = err.strip().splitlines()
        # verify names every finding (one line each); other commands fail with exactly one line
        assert lines and all(line.startswith("ckptd: error: ") for line in lines), (argv, err)
        assert len(lines) == 1 or argv[0] == "verify", (argv, err)
    return rc


@pytest.mark.parametrize("name", sorted(MANIFEST_MUTATIONS))
def test_hostile_manifest_is_one_clean_error(tmp_path, capsys, name):
    root = make_root(tmp_path / "job", steps=(1,))
    path = root / STEP / "manifest.json"
    new = MANIFEST_MUTATIONS[name](json.loads(path.read_text()))
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    for argv in (("show", root), ("verify", root), ("ls", root)):
        _main(capsys, *argv)
    with contextlib.suppress(CheckpointError):  # the one error type; any other fails the test
        _restore(root)


RECORD_MUTATIONS = {
    "commit deep": ("commit.json", DEEP),
    "commit a list": ("commit.json", "[]"),
    "commit wrong types": ("commit.json", json.dumps({"world_size": "x", "bytes": 10**400, "time": "y"})),
    "commit huge time": ("commit.json", json.dumps({"world_size": 1, "bytes": 1, "time": 1e308})),
    "zarr.json deep": ("arrays/model/w/zarr.json", DEEP),
    "zarr.json wrong": ("arrays/model/w/zarr.json", json.dumps({"shape": 5, "codecs": "x"})),
    "zarr.json a list": ("arrays/model/w/zarr.json", "[1]"),
}


@pytest.mark.parametrize("name", sorted(RECORD_MUTATIONS))
def test_hostile_records_are_one_clean_error(tmp_path, capsys, name):
    root = make_root(tmp_path / "job", steps=(1,))
    rel, text = RECORD_MUTATIONS[name]
    (root / STEP / rel).write_text(text)
    for argv in (("ls", root), ("show", root), ("verify", root), ("gc", root, "--keep-last", 1)):
        _main(capsys, *argv)
    p = cli("ls", root)  # and once as a real process: no traceback on stderr
    assert "Traceback" not in p.stderr and p.returncode in (0, 1), p.stderr


def test_hostile_done_record_is_one_clean_error(root):
    # The done record pins what its rank wrote (issue 26): without it the step cannot be checked,
    # so restore refuses it with one clear error (it used to restore without the RNG state).
    done = next((root / STEP / "_done").rglob("*.json"))
    done.write_text(DEEP)
    with pytest.raises(CheckpointError, match="done record"):
        _restore(root)
    os.unlink(done)
    with pytest.raises(CheckpointError, match="done record"):
        _restore(root)
