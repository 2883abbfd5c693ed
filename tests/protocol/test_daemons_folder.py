"""The daemons' discovery folder ``<job root>/_daemons/`` (``ckptd.server.discovery``) is not
part of any checkpoint: its name is reserved (``manifest.is_reserved``: no part's metadata may
name it), and ``ls``, ``verify``, ``gc`` and the latest step see the root exactly as without it
(and ``gc`` never deletes it)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptd import catalog, persist
from ckptd import manifest as mf
from ckptd.cli.main import main
from ckptd.errors import CheckpointError
from ckptd.savejob import SaveJob
from storage_backends import memory, open_store
from trainer_hooks import Checkpointer


@pytest.mark.parametrize("key", [f"{mf.DAEMONS}/0123456789abcdef0123456789abcdef.json", f"{mf.DAEMONS}/x"])
def test_the_daemons_folder_is_reserved(key):
    assert mf.is_reserved(key)
    assert not mf.is_reserved(f"{mf.DAEMONS}x") and not mf.is_reserved(f"{mf.ARRAYS}/{mf.DAEMONS}/zarr.json")
    store = memory.MemoryStore()
    part = SaveJob(step=1, attempt="a", rank=0, world_size=1, metadata=[(key, b"{}")])
    with ThreadPoolExecutor(2) as pool, pytest.raises(CheckpointError, match="reserved"):
        persist.persist(store, part, pool, writer="job")


def _digest(folder: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    out, _ = capsys.readouterr()
    return rc, out


def test_ls_verify_gc_and_latest_ignore_the_daemons_folder(tmp_path, capsys):
    root = tmp_path / "job"
    for step in (1, 2, 3):
        torch.manual_seed(step)
        with Checkpointer(str(root)) as ck:
            ck.save(step, {"w": torch.randn(8, 4)}).result()
    before = {
        "verify": _cli(capsys, "verify", root, "--all", "--json"),
        "ls": _cli(capsys, "ls", root, "--json"),
        "latest": catalog.latest_step(open_store(str(root))),
    }
    rec = {"format": 1, "daemon": "0" * 32, "advertise": "http://127.0.0.1:1", "heartbeat": 1, "version": "x"}
    (root / mf.DAEMONS).mkdir()
    (root / mf.DAEMONS / f"{'0' * 32}.json").write_text(json.dumps(rec))
    (root / mf.DAEMONS / "step_0000000009").mkdir()  # a step-looking name inside it: still not a step
    (root / mf.DAEMONS / "step_0000000009" / mf.COMMIT).write_text("{}")
    kept = _digest(root / mf.DAEMONS)
    after = {
        "verify": _cli(capsys, "verify", root, "--all", "--json"),
        "ls": _cli(capsys, "ls", root, "--json"),
        "latest": catalog.latest_step(open_store(str(root))),
    }
    assert after == before and before["latest"] == 3
    rc, _ = _cli(capsys, "gc", root, "--keep-last", "1")
    assert rc == 0
    assert [i.step for i in catalog.list_checkpoints(open_store(str(root)))] == [3]
    assert _digest(root / mf.DAEMONS) == kept
