"""What each rank does in the interop tests (run by worker.py, launched like launch.py
launches scenarios.py). Reuses the toy model and helpers of scenarios.py."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tests.distributed.scenarios import compare_with_reference, make_state, save_reference, train_step
from trainer_hooks import Checkpointer


def _dcp_state(state: dict) -> dict:
    """The state as DCP users hand it to dcp.save/dcp.load: FQN-keyed model and optimizer state
    dicts (DTensors under FSDP), the scheduler as a Stateful, plain dicts as they are."""
    model, optim = state["model"], state["optim"]
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "sched": state["sched"],
        "extra": state["extra"],
        "meta": state["meta"],
    }


def save_dcp_and_ckptd(layout: str, dcp_dir: str, root: str, out: str, steps: int = 2, seed: int = 0) -> dict:
    """Train ``steps`` steps; save the same state with dcp.save (to ``dcp_dir``) and with
    Checkpointer (to ``root``, step ``steps - 1``); record the full state for comparisons and the
    loss of one more step (the uninterrupted reference)."""
    state, dp_rank, dp_size = make_state(layout, seed)
    losses = [train_step(state, s, dp_rank, dp_size) for s in range(steps)]
    dcp.save(_dcp_state(state), checkpoint_id=dcp_dir)
    ck = Checkpointer(root)
    ck.save(steps - 1, state).result()
    ck.close()
    save_reference(state, layout, out)
    next_loss = train_step(state, steps, dp_rank, dp_size)
    return {"losses": losses, "next_loss": next_loss, "saved_step": steps - 1}


def load_dcp(layout: str, dcp_dir: str, out: str, ref: str, next_step: int, seed: int = 123) -> dict:
    """dcp.load a folder written by ``ckptd export --format dcp`` into a differently initialised
    state, the way a DCP user loads; compare with ``ref`` bitwise; one more step."""
    state, dp_rank, dp_size = make_state(layout, seed)
    sd = _dcp_state(state)
    dcp.load(sd, checkpoint_id=dcp_dir)
    set_model_state_dict(state["model"], sd["model"])
    set_optimizer_state_dict(state["model"], state["optim"], sd["optim"])
    state["meta"] = sd["meta"]
    mismatches = compare_with_reference(state, out, ref)
    sched_last_epoch = state["sched"].last_epoch
    next_loss = train_step(state, next_step, dp_rank, dp_size)
    return {"mismatches": mismatches, "next_loss": next_loss, "sched_last_epoch": sched_last_epoch, "meta": sd["meta"]}


def restore_imported(layout: str, root: str, out: str, ref: str, next_step: int, seed: int = 123) -> dict:
    """Checkpointer.restore of a checkpoint imported from DCP into a differently initialised
    state; compare with ``ref`` bitwise; one more step.

    DCP stored the scheduler through its state_dict, so it comes in as a ``dict`` entry; it is
    restored into a dict here and handed to the scheduler (Checkpointer.restore would replace a
    live Stateful by the dict: see test_interop.py in tests/e2e)."""
    state, dp_rank, dp_size = make_state(layout, seed)
    sched_state: dict = {}
    ck = Checkpointer(root)
    step = ck.restore({**state, "sched": sched_state})
    ck.close()
    state["sched"].load_state_dict(sched_state)
    mismatches = compare_with_reference(state, out, ref)
    sched_last_epoch = state["sched"].last_epoch
    next_loss = train_step(state, next_step, dp_rank, dp_size)
    return {
        "step": step,
        "mismatches": mismatches,
        "next_loss": next_loss,
        "sched_last_epoch": sched_last_epoch,
        "meta": state["meta"],
    }
