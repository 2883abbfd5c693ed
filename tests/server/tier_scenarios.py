"""What each trainer rank does in the memory-tier tests (``test_tiers.py``; run by
``tests/distributed/worker.py``): save through one daemon per node, restore through a node's
daemon at another world size."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tests.distributed.scenarios import compare_with_reference, full_state, make_state, train_step, world
from trainer_hooks import Checkpointer

LOG_LEVEL = logging.INFO


def save_steps(daemons: list[str], root: str, out: str, steps: list[int], hang: bool = False, seed: int = 0) -> dict:
    """Train; after each of ``steps`` save through this rank's node daemon (ranks split evenly
    over ``daemons``, in order: 2 per node at 4 ranks and 2 daemons), wait for the commit and
    record the full state as ``ref_step{s}.pt``. ``hang``: then flag ``saved_{rank}`` and wait
    to be killed (a node failure)."""
    rank, ws = world()
    state, dp_rank, dp_size = make_state("fsdp", seed)
    ck = Checkpointer(root, daemon=daemons[rank * len(daemons) // ws])
    for s in range(max(steps) + 1):
        train_step(state, s, dp_rank, dp_size)
        if s in steps:
            ck.save(s, state).result()
            ref = full_state(state)
            if rank == 0:
                torch.save(ref, Path(out) / f"ref_step{s}.pt")
    ck.close()
    if hang:
        Path(out, f"saved_{rank}").write_text("1")
        time.sleep(600)
    return {}


def save_direct(root: str, out: str, step: int, seed: int = 1) -> dict:
    """Save ``step`` straight to the job root (no daemon: no memory tier holds it)."""
    rank, _ = world()
    state, dp_rank, dp_size = make_state("fsdp", seed)
    train_step(state, step, dp_rank, dp_size)
    with Checkpointer(root) as ck:
        ck.save(step, state).result()
    ref = full_state(state)
    if rank == 0:
        torch.save(ref, Path(out) / f"ref_step{step}.pt")
    return {}


def restore_tiered(daemon: str, root: str, out: str, ref: str, step: int | None = None, seed: int = 123) -> dict:
    """Restore through ``daemon`` (this node's) into a differently initialised state at this
    world size; compare with ``ref`` bitwise; report the bytes read per tier."""
    state, _, _ = make_state("fsdp", seed)
    with Checkpointer(root, daemon=daemon) as ck:
        got = ck.restore(state, step)
        tiers = ck.last_restore_tiers
    return {"step": got, "mismatches": compare_with_reference(state, out, ref), "tiers": tiers}
