"""What each trainer rank does in the memory-only step campaign (``tests.faults.tier_campaign``;
run by ``tests/distributed/worker.py``): save every step through this rank's node daemon with
``persist_every`` until killed, marking each step whose future resolved; restore through a
daemon at any world size and check the restored step against its reference, bitwise."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tests.distributed.scenarios import BATCH, compare_with_reference, full_state, make_state, train_step, world
from trainer_hooks import Checkpointer

LOG_LEVEL = logging.INFO


def _put(path: Path, write) -> None:
    """``write(tmp)`` then rename onto ``path``: a rank killed meanwhile leaves no half file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_steps(daemons: list[str], root: str, out: str, steps: int, persist_every: int) -> dict:
    """Train steps 1..``steps``, saving each through this rank's node daemon (ranks split evenly
    over ``daemons``) with ``persist_every`` and waiting for it. Rank 0 writes step s's full
    state as ``ref_step{s}.pt`` *before* the save begins (so every step a restore can find has
    its reference); every rank writes s to ``done_{rank}`` once step s's future resolved (a
    kill leaves the newest step acknowledged on that rank). ``started_{rank}``: step 1 begins."""
    rank, ws = world()
    state, dp_rank, dp_size = make_state("fsdp", 0)
    ck = Checkpointer(root, daemon=daemons[rank * len(daemons) // ws], persist_every=persist_every)
    out_dir = Path(out)
    _put(out_dir / f"started_{rank}", lambda p: p.write_text(str(time.time())))
    for s in range(1, steps + 1):
        train_step(state, s, dp_rank, dp_size)
        state["extra"]["position"] = torch.tensor([s * BATCH * ws], dtype=torch.int64)
        ref = full_state(state)
        if rank == 0:
            _put(out_dir / f"ref_step{s}.pt", lambda p, ref=ref: torch.save(ref, p))
        ck.save(s, state).result()
        _put(out_dir / f"done_{rank}", lambda p, s=s: p.write_text(str(s)))
    ck.close()
    return {}


def restore_step(daemon: str, root: str, out: str, refs: str, saved_world: int) -> dict:
    """Restore through ``daemon`` at this world size into a differently initialised state; the
    step restored (0: none), how long the restore took, the bytes per tier, and the keys that
    differ from that step's reference in ``refs`` (bitwise, the data position included; a step
    without a reference is a wrong restore: its save had not begun)."""
    state, _, _ = make_state("fsdp", 123)
    state["extra"]["position"] = torch.tensor([-1], dtype=torch.int64)
    t0 = time.monotonic()
    with Checkpointer(root, daemon=daemon) as ck:
        got = ck.restore(state) or 0
        tiers = dict(ck.last_restore_tiers or {})
    seconds = time.monotonic() - t0
    ref = Path(refs, f"ref_step{got}.pt")
    if got == 0:
        mismatches = []
    elif ref.exists():
        mismatches = compare_with_reference(state, refs, ref.name)
    else:
        mismatches = [f"no reference for step {got}: its save had not begun"]
    position = int(state["extra"]["position"])
    if got and position != got * BATCH * saved_world and world()[0] == 0:
        mismatches.append(f"data position {position}, not {got * BATCH * saved_world}")
    return {"step": got, "mismatches": mismatches, "tiers": tiers, "seconds": seconds}
