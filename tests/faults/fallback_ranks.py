"""One rank of the 2-rank fallback test (``test_verdicts.py``): ``save`` commits steps 1, 2, 3;
``restore`` restores with ``fallback=True`` and writes the step and its values to OUT/rank<r>.json."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.local_launch import exit_after
from trainer_hooks import Checkpointer


def state(seed: int) -> dict:
    return {"w": torch.full((8, 4), float(seed)), "b": torch.arange(4, dtype=torch.float32) + seed}


def main(phase: str, root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Checkpointer(root) as ck:
        if phase == "save":
            for step in (1, 2, 3):
                ck.save(step, state(step)).result()
        else:
            got = state(0)
            step = ck.restore(got, fallback=True)
            doc = {"step": step, "w": got["w"][0, 0].item(), "skipped": [s for s, _ in ck.last_restore_skipped]}
            with open(f"{out}/rank{rank}.json", "w") as f:
                json.dump(doc, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_after(main, *sys.argv[1:4])
