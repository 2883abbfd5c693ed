"""What runs in the processes the fault tests kill: a trainer that saves steps in a loop.

They run as children of a ``forkserver`` (``tests.faults.campaign.Pool``) that imported torch
and this module once, so a new trainer starts in milliseconds instead of seconds and dozens can
be killed per test run. Every value a trainer saves comes from a seeded generator, never from
arithmetic, so the checking process rebuilds the exact bytes of any step (``campaign_state``).
"""

from __future__ import annotations

import logging
import os
import time

import torch

import trainer_hooks  # noqa: F401 - imported by the forkserver before it forks
from ckptd.errors import CheckpointError

BIG = 6 << 20  # bytes of the optional large tensor: over S3's 5 MiB part, so it goes multipart


def campaign_state(step: int, big: bool = False) -> dict:
    """The state a trainer saves at ``step`` (a tensor of ``BIG`` bytes too when ``big``)."""
    g = torch.Generator().manual_seed(1000 + step)
    w = {
        "a": torch.randn(96, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 1 << 30, (33, 7), generator=g),
    }
    if big:
        w["big"] = torch.randn(BIG // 4, generator=g)
    return {"w": w}


def empty_state(big: bool = False) -> dict:
    s = campaign_state(0, big)
    return {"w": {k: torch.zeros_like(v) for k, v in s["w"].items()}}


def same_state(a: dict, b: dict) -> bool:
    return a["w"].keys() == b["w"].keys() and all(
        a["w"][k].dtype == b["w"][k].dtype and a["w"][k].view(torch.uint8).equal(b["w"][k].view(torch.uint8))
        for k in a["w"]
    )


def _note(progress: str, line: str) -> None:
    with open(progress, "a") as f:
        f.write(line + "\n")
        f.flush()


def trainer(
    root: str,
    first: int,
    count: int,
    progress: str,
    keep_last: int | None = None,
    env: dict | None = None,
    big: bool = False,
    slow_rename_s: float = 0.0,
    daemon: str | None = None,
    hang: bool = False,
) -> None:
    """Save steps ``first .. first+count-1`` of ``campaign_state``, one after the other, each
    waited for. Appends ``begin N`` / ``ok N`` / ``fail N <error>`` lines to ``progress``.
    ``slow_rename_s``: an injected slow disk: every data file of a save is written, then sits
    as a temp file that long before it is linked into place. ``hang``: after the last save, wait
    to be killed."""
    os.environ.update(env or {})
    logging.basicConfig(level=logging.CRITICAL)
    from trainer_hooks import Checkpointer

    ck = Checkpointer(root, keep_last=keep_last, daemon=daemon, commit_timeout=120)
    if slow_rename_s:
        real = ck.store._make_temp

        def slow_make_temp(key, *args, **kwargs):
            made = real(key, *args, **kwargs)  # the complete temp file, not yet linked into place
            if "/_claims/" not in key and "/_done/" not in key:  # the save's data and metadata
                time.sleep(slow_rename_s)
            return made

        ck.store._make_temp = slow_make_temp
    for step in range(first, first + count):
        _note(progress, f"begin {step}")
        t0 = time.monotonic()
        try:
            ck.save(step, campaign_state(step, big)).result()
        except CheckpointError as e:
            _note(progress, f"fail {step} {time.monotonic() - t0:.3f} {' '.join(str(e).split())}")
            continue
        _note(progress, f"ok {step} {time.monotonic() - t0:.3f}")
    _note(progress, "done")
    if hang:
        time.sleep(3600)
    ck.close()
