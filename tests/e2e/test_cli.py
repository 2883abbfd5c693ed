"""The ``ckptd`` command line against real checkpoints made by ``trainer_hooks.Checkpointer``.

Most tests call ``main([...])`` in-process (fast); a few run the installed entry point as a real
subprocess to check exit codes and that stderr never carries a traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from ckptd import __version__
from ckptd.cli.common import Progress, human_bytes, iso_time
from ckptd.cli.main import COMMANDS, main
from trainer_hooks import Checkpointer

STEPS = (100, 200, 300)
STEP_DIR = "step_{:010d}"


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    extra = {"emb": torch.randn(12, 6).to(torch.bfloat16), "epoch": 2}
    return {"model": model, "optim": opt, "extra": extra}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job root with three committed steps (same values at each), and the saved state."""
    root = str(tmp_path_factory.mktemp("cli") / "job")
    state = _state()
    ckpt = Checkpointer(root)
    try:
        for step in STEPS:
            ckpt.save(step, state)
    finally:
        ckpt.close()
    return root, state


@pytest.fixture
def root(saved, tmp_path):
    """A private copy of the saved job root, for tests that change it."""
    dst = str(tmp_path / "job")
    shutil.copytree(saved[0], dst)
    return dst


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptd: error: ")
    return lines[0]


# ------------------------------------------------------------------------------------------- ls


def test_ls_json_fields(saved, capsys):
    rows = run_json(capsys, "ls", saved[0])
    assert [r["step"] for r in rows] == list(STEPS)
    for r in rows:
        assert r["committed"] is True
        assert r["world_size"] == 1
        assert isinstance(r["bytes"], int) and r["bytes"] > 0
        assert isinstance(r["time"], float)
        assert r["checkpoint_path"] == STEP_DIR.format(r["step"])


def test_ls_table(saved, capsys):
    rc, out, err = run(capsys, "ls", saved[0])
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "STATUS", "WORLD"]
    assert len(lines) == 1 + len(STEPS)
    assert "committed" in lines[1] and "KiB" in lines[1] and "Z" in lines[1]


def test_partial_checkpoint(root, capsys):
    os.remove(os.path.join(root, STEP_DIR.format(300), "commit.json"))
    rows = {r["step"]: r for r in run_json(capsys, "ls", root)}
    assert rows[300]["committed"] is False and rows[200]["committed"] is True
    rc, out, err = run(capsys, "ls", root)
    assert rc == 0 and "partial" in out.splitlines()[-1]

    rc, out, err = run(capsys, "show", root, "--step", 300)
    assert rc == 1 and out == ""
    assert "partial" in one_error_line(err)
    rc, _, err = run(capsys, "verify", root, "--step", 300)
    assert rc == 1 and "partial" in one_error_line(err)
    # The default step is the latest *committed* one.
    assert run_json(capsys, "show", root)["step"] == 200


# ----------------------------------------------------------------------------------------- show


def test_show_json_paths_open_in_zarr_and_tensorstore(saved, capsys):
    root, state = saved
    doc = run_json(capsys, "show", root)
    assert doc["step"] == STEPS[-1]
    assert doc["checkpoint_path"] == STEP_DIR.format(STEPS[-1])
    assert doc["world_size"] == 1
    assert doc["state"] == {"model": "module", "optim": "optimizer", "extra": "dict"}
    tensors = {t["key"]: t for t in doc["tensors"]}
    for t in tensors.values():
        assert {"key", "shape", "dtype", "path", "shard_shape", "chunk_shape", "nbytes"} <= set(t)

    w = tensors["model/0.weight"]
    assert w["path"] == "arrays/model/0.weight"
    assert w["shape"] == [16, 8] and w["dtype"] == "float32"
    arr = zarr.open_array(os.path.join(root, doc["checkpoint_path"], w["path"]), mode="r")
    np.testing.assert_array_equal(arr[...], state["model"][0].weight.detach().numpy())

    ts = pytest.importorskip("tensorstore")
    e = tensors["extra/emb"]
    assert e["dtype"] == "bfloat16"
    path = os.path.join(root, doc["checkpoint_path"], e["path"])
    got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()
    want = state["extra"]["emb"].view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(got).view(np.int16), want)


def test_show_table(saved, capsys):
    rc, out, err = run(capsys, "show", saved[0], "--step", 200)
    assert rc == 0 and err == ""
    assert "step 200" in out
    assert "state: model (module), optim (optimizer), extra (dict)" in out
    row = next(line for line in out.splitlines() if line.startswith("extra/emb"))
    assert row.split()[:4] == ["extra/emb", "(12,", "6)", "bfloat16"]
    assert "arrays/extra/emb" in row


# --------------------------------------------------------------------------------------- verify


def test_verify_clean(saved, capsys):
    rc, out, err = run(capsys, "verify", saved[0])
    assert rc == 0 and err == ""
    assert "OK" in out and "arrays" in out
    doc = run_json(capsys, "verify", saved[0], "--step", 100)
    assert doc["ok"] is True and doc["step"] == 100
    # one object per array, except the 4 optimizer step counts: saved in their zarr.json
    assert doc["arrays"] == 17 and doc["objects"] == doc["arrays"] - 4 and doc["bytes"] > 0


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)


def test_verify_flipped_byte(root, capsys):
    step_dir = os.path.join(root, STEP_DIR.format(300))
    _flip_middle_byte(os.path.join(step_dir, "arrays", "model", "0.weight", "c", "0", "0"))
    rc, out, err = run(capsys, "verify", root)
    assert rc == 1 and out == ""
    line = one_error_line(err)
    assert "arrays/model/0.weight" in line and "crc32c" in line.lower()
    # Other steps are untouched.
    assert run(capsys, "verify", root, "--step", 200)[0] == 0

    _flip_middle_byte(os.path.join(step_dir, "arrays", "extra", "emb", "c", "0", "0"))
    rc, out, err = run(capsys, "verify", root, "--keep-going", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["errors"]) == 2
    assert len(err.strip().splitlines()) == 2


# ------------------------------------------------------------------------------------------- gc


def test_gc_dry_run_then_keep_last_1(root, capsys):
    before = sorted(os.listdir(root))
    doc = run_json(capsys, "gc", root, "--keep-last", 1, "--dry-run")
    assert doc["deleted"] == [100, 200] and doc["kept"] == [300]
    assert sorted(os.listdir(root)) == before

    rc, out, err = run(capsys, "gc", root, "--keep-last", 1)
    assert rc == 0, err
    assert [line.split(" (")[0] for line in out.splitlines()] == [
        f"deleted {STEP_DIR.format(100)}",
        f"deleted {STEP_DIR.format(200)}",
    ]
    assert sorted(os.listdir(root)) == ["_latest", STEP_DIR.format(300)]  # the latest-step chain stays
    assert [r["step"] for r in run_json(capsys, "ls", root)] == [300]


def test_gc_keeps_newer_partial(root, capsys):
    os.remove(os.path.join(root, STEP_DIR.format(300), "commit.json"))  # a save still in flight
    doc = run_json(capsys, "gc", root, "--keep-last", 1)
    assert doc["deleted"] == [100] and doc["kept"] == [200, 300]


# ------------------------------------------------------------------------------ errors and usage


def test_missing_root(tmp_path, capsys):
    missing = tmp_path / "nothing" / "here"
    rc, out, _ = run(capsys, "ls", missing)
    assert rc == 0 and out == ""
    assert run_json(capsys, "ls", missing) == []
    rc, out, err = run(capsys, "verify", missing)
    assert rc == 1 and out == ""
    assert "no committed checkpoint" in one_error_line(err)
    rc, _, err = run(capsys, "show", missing)
    assert rc == 1 and "no committed checkpoint" in one_error_line(err)
    assert not missing.exists()  # reading never creates the root


def test_usage_errors(saved, capsys):
    rc, _, err = run(capsys, "ls", "gs://bucket/job")
    assert rc == 2 and "unsupported URI scheme 'gs'" in one_error_line(err)
    assert run(capsys, "show", saved[0], "--step", "x")[0] == 2
    assert run(capsys, "gc", saved[0])[0] == 2  # --keep-last is required
    assert run(capsys, "gc", saved[0], "--keep-last", 0)[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys)[0] == 2
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and __version__ in out
    rc, _, err = run(capsys, "show", saved[0], "--step", 7)
    assert rc == 1 and "no such checkpoint" in one_error_line(err)


def test_registry_is_one_line_per_command():
    import importlib

    assert {"ls", "show", "verify", "gc"} <= set(COMMANDS)
    for module in COMMANDS.values():
        mod = importlib.import_module(f"ckptd.cli.{module}")
        assert callable(mod.add_arguments) and callable(mod.run) and mod.HELP


def test_subprocess_exit_codes_and_no_traceback(root, tmp_path):
    _flip_middle_byte(os.path.join(root, STEP_DIR.format(300), "arrays", "model", "2.weight", "c", "0", "0"))
    exe = shutil.which("ckptd")
    cmd = [exe] if exe else [sys.executable, "-m", "ckptd.cli.main"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}

    def sh(*argv, module=False):
        base = [sys.executable, "-m", "ckptd.cli.main"] if module else cmd
        return subprocess.run([*base, *map(str, argv)], capture_output=True, text=True, env=env, timeout=120)

    p = sh("ls", "--json", root, module=True)
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in json.loads(p.stdout)] == list(STEPS)

    p = sh("verify", root)
    assert p.returncode == 1 and p.stdout == ""
    assert "arrays/model/2.weight" in one_error_line(p.stderr)
    assert "Traceback" not in p.stderr

    p = sh("verify", root, "--step", 200)
    assert p.returncode == 0 and p.stderr == ""

    p = sh("verify", tmp_path / "missing")
    assert p.returncode == 1 and "no committed checkpoint" in one_error_line(p.stderr)

    p = sh("ls", "gs://bucket/job")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    one_error_line(p.stderr)


# ------------------------------------------------------------------------------------------- S3


@pytest.mark.s3
def test_cli_on_s3(s3_bucket, capsys):
    ckpt = Checkpointer(s3_bucket)
    try:
        for step in (1, 2):
            ckpt.save(step, _state())
    finally:
        ckpt.close()
    rows = run_json(capsys, "ls", s3_bucket)
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (2, True)]
    doc = run_json(capsys, "show", s3_bucket, "--step", 1)
    assert doc["checkpoint_path"] == STEP_DIR.format(1)
    assert {"model/0.weight", "extra/emb"} <= {t["key"] for t in doc["tensors"]}
    rc, out, err = run(capsys, "verify", s3_bucket)
    assert rc == 0 and "OK" in out, err
    assert run_json(capsys, "gc", s3_bucket, "--keep-last", 1)["deleted"] == [1]
    assert [r["step"] for r in run_json(capsys, "ls", s3_bucket)] == [2]
    missing = s3_bucket.rsplit("/", 1)[0] + "-missing/job"
    assert run_json(capsys, "ls", missing) == []


# -------------------------------------------------------------------------------------- helpers


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_only_on_a_terminal():
    pipe = _Stream(tty=False)
    with Progress("verifying", pipe) as p:
        p(1, 2)
        p(2, 2)
    assert pipe.getvalue() == ""
    term = _Stream(tty=True)
    with Progress("verifying", term) as p:
        p(2, 2)
    assert "verifying" in term.getvalue() and "2/2" in term.getvalue()


def test_human_formats():
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(3 << 20) == "3.0 MiB"
    assert iso_time(0.0) == "1970-01-01T00:00:00Z"
