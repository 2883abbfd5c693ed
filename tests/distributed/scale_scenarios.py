"""Scenarios of ``test_restore_broadcast``: run in each rank by ``worker.py``."""

from __future__ import annotations

import torch

from ckptd.errors import CheckpointError
from trainer_hooks import Checkpointer


def restore_with_bad_manifest(root: str, out: str) -> dict:
    """Every rank restores a checkpoint whose manifest rank 0 alone reads (and broadcasts):
    rank 0's error must reach every rank, and no rank's state may change."""
    state = {"w": torch.full((4,), -1.0)}
    with Checkpointer(root) as ck:
        try:
            ck.restore(state)
        except CheckpointError as e:
            return {"error": str(e), "untouched": bool((state["w"] == -1).all())}
    return {"error": None}


def restore_ok(root: str, out: str) -> dict:
    state = {"w": torch.zeros(4)}
    with Checkpointer(root) as ck:
        step = ck.restore(state)
    return {"step": step, "w": state["w"].tolist()}
