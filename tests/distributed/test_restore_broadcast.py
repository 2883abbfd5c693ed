"""Restore reads the manifest on rank 0 only and broadcasts it (one GET per restore, not two
requests per rank on one prefix): every rank still gets it, and rank 0's error fails every rank
with the state untouched."""

from __future__ import annotations

import pytest
import torch

from ckptd import manifest as mf
from storage_backends import open_store
from tests.distributed import launch
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCENARIOS = "tests.distributed.scale_scenarios"


def _saved(tmp_path) -> str:
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(3, {"w": torch.arange(4.0)}).result()
    return root


def test_every_rank_gets_the_manifest_rank_0_read(tmp_path):
    root = _saved(tmp_path)
    results = launch.run(2, "restore_ok", tmp_path / "out", scenarios=SCENARIOS, root=root)
    assert results == [{"step": 3, "w": [0.0, 1.0, 2.0, 3.0]}] * 2


def test_a_manifest_rank_0_cannot_read_fails_every_rank(tmp_path):
    root = _saved(tmp_path)
    open_store(root).put(f"{mf.step_dir(3)}/{mf.MANIFEST}", b"{not json")
    results = launch.run(2, "restore_with_bad_manifest", tmp_path / "out", scenarios=SCENARIOS, root=root)
    for r in results:
        assert "manifest is not valid JSON" in r["error"] and r["untouched"], r
