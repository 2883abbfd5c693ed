"""Scenarios for the ops tests, run in real ranks by ``tests.distributed.launch`` (gloo on CPU).

``save_fsdp`` saves a freshly seeded FSDP model (no training step: the values are the same at
every world size, so a 4-rank and a 3-rank save hold the same state in different layouts) plus a
few loose tensors (bfloat16 included) and JSON state."""

from __future__ import annotations

import torch

from tests.distributed.scenarios import build, world
from trainer_hooks import Checkpointer


def save_fsdp(roots: list[str], out: str, step: int = 1, seed: int = 0, changed_at: int = 0) -> dict:
    """Save ``step`` to every root. With ``changed_at``, then save that step too, changed in three
    known ways: ``extra/big[0, 0]`` += 1e-3, a new tensor ``extra/new``, ``meta/note`` "a" -> "b"."""
    model, _, _ = build("fsdp", seed)
    g = torch.Generator().manual_seed(seed)
    extra = {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "i64": torch.arange(10, dtype=torch.int64),
        "big": torch.randn(300, 64, generator=g),
    }
    state = {"model": model, "extra": extra, "meta": {"seed": seed, "note": "a", "lr": [0.1, 0.01]}}
    for root in roots:
        ck = Checkpointer(root)
        ck.save(step, state).result()
        if changed_at:
            extra["big"][0, 0] += 1e-3
            extra["new"] = torch.ones(4)
            state["meta"]["note"] = "b"
            ck.save(changed_at, state).result()
        ck.close()
    rank, ws = world()
    return {"rank": rank, "world_size": ws}
