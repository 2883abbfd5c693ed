"""What each trainer rank does in the daemon tests (run by ``tests/distributed/worker.py``). They
reuse the model, training step and reference state of ``tests/distributed/scenarios.py``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tests import load
from tests.distributed.scenarios import full_state, make_state, save_reference, train_step, world
from trainer_hooks import Checkpointer

LOG_LEVEL = logging.INFO  # the worker logs at this level: the rank logs show the daemon handoffs


def _flag(out: str, name: str) -> None:
    Path(out, name).write_text("1")


def _layout() -> str:
    return "fsdp" if world()[1] > 1 else "single"


def _train_and_record(out: str, step: int, seed: int) -> dict:
    """Train steps 0..``step`` and record the full state as the reference; returns the state."""
    layout = _layout()
    state, dp_rank, dp_size = make_state(layout, seed)
    for s in range(step + 1):
        train_step(state, s, dp_rank, dp_size)
    save_reference(state, layout, out)
    return state


def save_and_hang(daemons: list[str], root: str, out: str, step: int = 1, seed: int = 0) -> dict:
    """Train, record the full state as the reference, save through the daemon (rank r uses
    ``daemons[r % len(daemons)]``: one daemon per node), say that save returned, then wait to be
    killed with SIGKILL."""
    rank, _ = world()
    state = _train_and_record(out, step, seed)
    ck = Checkpointer(root, daemon=daemons[rank % len(daemons)])
    ck.save(step, state)
    _flag(out, f"save_returned_{rank}")
    time.sleep(600)
    return {}


def save_and_wait(daemons: list[str], root: str, out: str, step: int = 1, seed: int = 0) -> dict:
    """Like ``save_and_hang`` but wait for the commit and report what the future says."""
    rank, _ = world()
    state = _train_and_record(out, step, seed)
    with Checkpointer(root, daemon=daemons[rank % len(daemons)]) as ck:
        res = ck.save(step, state).result()
    return {"committed_here": res.committed_here}


def save_across_daemon_crash(daemon: str, root: str, out: str) -> dict:
    """Commit step 1; save step 2 (the test kills and restarts the daemon during its upload) and
    wait for its outcome; then save step 3. References of steps 1 and 3 go to ``out``."""
    state, dp_rank, dp_size = make_state("single", 0)
    ck = Checkpointer(root, daemon=daemon, commit_timeout=240)
    train_step(state, 0, dp_rank, dp_size)
    torch.save(full_state(state), Path(out) / "ref_step1.pt")
    ck.save(1, state).result()
    train_step(state, 1, dp_rank, dp_size)
    fut = ck.save(2, state)
    _flag(out, "save2_returned")
    try:
        fut.result()
        step2 = "committed"
    except Exception as e:  # noqa: BLE001 - reported to the test
        step2 = f"failed: {e}"
    train_step(state, 2, dp_rank, dp_size)
    torch.save(full_state(state), Path(out) / "ref_step3.pt")
    res = ck.save(3, state).result()
    ck.close()
    return {"step2": step2, "step3_committed_here": res.committed_here}


def save_big(daemon: str, root: str, out: str, wait_for: str | None = None, tag: str = "") -> dict:
    """One save of a state dominated by a 256 KiB tensor, timed. With ``wait_for``, the save
    starts only once that file exists (the other trainer's save has returned)."""
    g = torch.Generator().manual_seed(0)
    state = {"w": {"big": torch.randn(256, 256, generator=g), "small": torch.randn(16, generator=g)}}
    with Checkpointer(root, daemon=daemon) as ck:
        if wait_for is not None:
            deadline = load.deadline(120)
            while not Path(wait_for).exists():
                assert time.monotonic() < deadline, "the other trainer never saved"
                time.sleep(0.01)
        t0 = time.perf_counter()
        fut = ck.save(1, state)
        blocked = time.perf_counter() - t0
        _flag(out, f"returned_{tag}")
        fut.result()
    return {"blocked_s": blocked}
