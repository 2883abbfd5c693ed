"""A one-rank trainer for the ops tests, run as ``python -m tests.ops.saver DAEMON ROOT FLAGDIR``.

Commits steps 1-3 of a small state through the daemon (for the page's chart), then hands off
step 4, a state of ``BIG`` tensors, writes ``FLAGDIR/handed_off`` and sleeps until the test
kills it: the daemon owns step 4 from the hand-off on, and uploads it (slowly, in the test)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from trainer_hooks import Checkpointer

BIG = 64


def main(daemon: str, root: str, flags: str) -> None:
    small = {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "epoch": 1}
    ck = Checkpointer(root, daemon=daemon, commit_timeout=600)
    for step in (1, 2, 3):
        small["model"]["w"] += 1
        ck.save(step, small).result()
    big = {"model": {f"layer{i}.weight": torch.full((256, 64), float(i)) for i in range(BIG)}, "epoch": 4}
    ck.save(4, big)
    (Path(flags) / "handed_off").write_text("4")
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
