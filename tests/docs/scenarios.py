"""What a runbook section of docs/operations.md presumes before its first command: a job root
(``$ROOT``) that a real job wrote, in the state the section's title describes. Made with the
real writer (``Checkpointer``) and real processes; the only thing stood in for is time: a dead
writer's files are dated back, as if the node had died minutes ago (its lease ran out)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from tests.faults.test_slow_writer import writing_writer
from trainer_hooks import Checkpointer


def model_state(seed: int) -> dict:
    """The state the operations.md examples restore: ``{"model": torch.nn.Linear(8, 8)}``."""
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(8, 8)}


def committed(root: str, steps: list[int], job_id: str = "run-42") -> None:
    with Checkpointer(root, job_id=job_id) as ck:
        for step in steps:
            ck.save(step, model_state(step)).result(timeout=120)


def dead_writer(root: str, job_id: str, step: int, scratch: Path, minutes_ago: float = 5) -> None:
    """A writer of ``job_id`` SIGKILLed while it wrote ``step`` (a partial step, claimed), its
    files dated ``minutes_ago`` back: its lease (60 s after the last heartbeat) ran out."""
    out = scratch / f"dead-{job_id}-{step}"
    proc = writing_writer(root, job_id, 1, step, out)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    then = time.time() - minutes_ago * 60
    for folder, _dirs, files in os.walk(Path(root) / f"step_{step:010d}"):
        for name in files:
            os.utime(Path(folder) / name, (then, then))


def corrupt_newest_chunk(root: str, step: int) -> Path:
    """Flip one byte of the first chunk of step ``step``'s ``model/weight`` shard object."""
    shard = next((Path(root) / f"step_{step:010d}" / "arrays" / "model" / "weight" / "c").rglob("*"))
    while shard.is_dir():
        shard = next(shard.iterdir())
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    return shard


# (file, section title) -> setup(root, scratch). A section not listed here starts from an empty
# scratch folder and an empty bucket.
def _node_died(root: str, scratch: Path) -> None:
    committed(root, [1, 2, 3])
    dead_writer(root, "run-42", 4, scratch)


def _corrupt(root: str, scratch: Path) -> None:
    committed(root, [100, 200, 300])
    corrupt_newest_chunk(root, 300)


def _storage_down(root: str, scratch: Path) -> None:
    committed(root, [1, 2, 3])
    dead_writer(root, "run-42", 4, scratch)


def _fence(root: str, scratch: Path) -> None:
    committed(root, [9], job_id="X")
    dead_writer(root, "X", 14, scratch)


SETUP = {
    ("docs/operations.md", "A node died (trainer or daemon killed mid-save)"): _node_died,
    ("docs/operations.md", "A checkpoint is corrupt"): _corrupt,
    ("docs/operations.md", "Storage is down or slow"): _storage_down,
    ("docs/operations.md", "A restarted job skips the dead job's step (`ckptd fence`)"): _fence,
}
