"""One training job for the two-writer tests: ``python -m tests.e2e.writer_job ROOT NAME VALUE
OUT STEPS``. Saves steps 1..STEPS of a state whose every tensor holds VALUE, meeting the other
job at a file barrier before each save (so both save the same step at the same time), and
writes what became of each save to OUT/NAME.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tests import load
from trainer_hooks import Checkpointer


def barrier(out: Path, name: str, step: int) -> None:
    (out / f"{name}.ready{step}").write_text("1")
    deadline = load.deadline(120)
    while len(list(out.glob(f"*.ready{step}"))) < 2:
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: the other job never reached step {step}")
        time.sleep(0.005)


def main(root: str, name: str, value: float, out: Path, steps: int) -> None:
    state = {"t": {f"w{i}": torch.full((64, 64), value) for i in range(8)}, "who": name}
    outcome = {}
    with Checkpointer(root) as ck:
        for step in range(1, steps + 1):
            barrier(out, name, step)
            try:
                exc = ck.save(step, state).exception(timeout=120)
            except Exception as e:  # noqa: BLE001 - refused on the spot: recorded like a failure
                exc = e
            outcome[step] = None if exc is None else f"{type(exc).__name__}: {exc}"
        outcome["job_id"] = getattr(ck, "job_id", name)
    (out / f"{name}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
