"""What each trainer rank does in the memory-only step tests (``test_memory_steps.py``; run by
``tests/distributed/worker.py``): train and save every step through this rank's node daemon with
``persist_every``, the data position (samples consumed) part of the state; restore through a
node's daemon at another world size (``restore_tiered``)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tests.distributed.scenarios import BATCH, compare_with_reference, full_state, make_state, train_step, world
from trainer_hooks import Checkpointer, ElasticSampler

LOG_LEVEL = logging.INFO


def save_memory(
    daemons: list[str],
    root: str,
    out: str,
    last: int,
    persist_every: int,
    stall_rank_from: int | None = None,
    hang: bool = True,
    gate: bool = False,
    seed: int = 0,
) -> dict:
    """Train steps 1..``last``; after each, save it through this rank's node daemon (ranks split
    evenly over ``daemons``) with ``persist_every`` and wait for the save; record the full state
    as ``ref_step{s}.pt``. The state's ``extra/position`` counts the samples consumed so far (a
    restore puts the data loader exactly there). Then flag ``saved_{rank}`` and wait to be
    killed (``hang``; else close and return). ``stall_rank_from``: ranks from this one on hang
    inside the hand-off of step ``last`` (after the step's collectives: their node dies during
    that save). ``gate``: before step ``last``'s save, wait for the file ``go`` in ``out``.
    ``seed``: the model's initial weights (another seed: other weights at every step)."""
    rank, ws = world()
    state, dp_rank, dp_size = make_state("fsdp", seed)
    ck = Checkpointer(root, daemon=daemons[rank * len(daemons) // ws], persist_every=persist_every)
    position = 0
    for s in range(1, last + 1):
        train_step(state, s, dp_rank, dp_size)
        position += BATCH * ws  # the samples of this step, every rank's batch
        state["extra"]["position"] = torch.tensor([position], dtype=torch.int64)
        while gate and s == last and not Path(out, "go").exists():
            time.sleep(0.05)
        if s == last and stall_rank_from is not None and rank >= stall_rank_from:

            def stall(job):
                Path(out, f"saved_{rank}").write_text("stalled")
                time.sleep(600)

            # this node dies before its part of the step reaches its daemon
            ck._sink.submit = ck._sink.submit_memory = stall
        fut = ck.save(s, state)
        fut.result()
        ref = full_state(state)
        if rank == 0:
            torch.save(ref, Path(out) / f"ref_step{s}.pt")
    if not hang:
        ck.close()
        return {}
    Path(out, f"saved_{rank}").write_text("1")
    time.sleep(600)
    return {}


def restore_position(daemon: str | list[str], root: str, out: str, ref: str, seed: int = 123) -> dict:
    """Restore through ``daemon`` (this node's; a list: ranks split evenly over it) into a
    differently initialised state at this world size; compare with ``ref`` bitwise; report the
    step, the data position and the bytes read per tier."""
    if isinstance(daemon, list):
        rank, ws = world()
        daemon = daemon[rank * len(daemon) // ws]
    state, _, _ = make_state("fsdp", seed)
    state["extra"]["position"] = torch.tensor([-1], dtype=torch.int64)
    with Checkpointer(root, daemon=daemon) as ck:
        got = ck.restore(state)
        tiers = ck.last_restore_tiers
    mismatches = compare_with_reference(state, out, ref)
    return {"step": got, "position": int(state["extra"]["position"]), "mismatches": mismatches, "tiers": tiers}


DATASET = 100  # samples in the epoch of ``save_sampled`` / ``resume_sampled``
PER_STEP = 2  # samples each rank draws per step


def save_sampled(root: str, out: str, last: int, persist_every: int) -> dict:
    """README "Through the daemon" as printed, with no address: ``daemon=True`` (this rank's
    node's socket in ``CKPTD_SOCKET``, the token in ``CKPTD_TOKEN_FILE``). Train steps
    1..``last``, each drawing ``PER_STEP`` samples from an ``ElasticSampler`` (part of the state),
    saving every step with ``persist_every`` and waiting for it; the samples drawn so far go to
    ``seen_{rank}.json``, the full state of step s to ``ref_step{s}.pt``. Then flag
    ``saved_{rank}`` and wait to be killed."""
    rank, ws = world()
    state, dp_rank, dp_size = make_state("fsdp", 0)
    state["sampler"] = sampler = ElasticSampler(DATASET, seed=7)
    ck = Checkpointer(root, daemon=True, persist_every=persist_every)
    it, seen = iter(sampler), []
    for s in range(1, last + 1):
        seen += [next(it) for _ in range(PER_STEP)]
        train_step(state, s, dp_rank, dp_size)
        ck.save(s, state).result()
        Path(out, f"seen_{rank}.json").write_text(json.dumps(seen))
        ref = full_state(state)
        if rank == 0:
            torch.save(ref, Path(out) / f"ref_step{s}.pt")
    Path(out, f"saved_{rank}").write_text("1")
    time.sleep(600)
    return {}


def resume_sampled(root: str, out: str, ref: str) -> dict:
    """Resume with ``daemon=True`` at this world size into a differently initialised state;
    compare with ``ref`` bitwise; return the step, the bytes per tier and the samples this rank
    draws for the rest of the epoch."""
    state, _, _ = make_state("fsdp", 123)
    state["sampler"] = sampler = ElasticSampler(DATASET, seed=7)
    with Checkpointer(root, daemon=True) as ck:
        got = ck.restore(state)
        tiers = ck.last_restore_tiers
    mismatches = compare_with_reference(state, out, ref)
    return {"step": got, "mismatches": mismatches, "tiers": tiers, "rest": list(sampler)}
