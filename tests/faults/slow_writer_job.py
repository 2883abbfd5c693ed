"""A writer that stalls in the middle of its save, for the slow-writer tests:
``python -m tests.faults.slow_writer_job ROOT JOB_ID SEED STEP OUT``.

Saves ``state(SEED)`` at STEP as job JOB_ID. Its first shard write (``arrays/.../c/...``)
writes ``OUT/writing`` and then blocks reading a line from stdin, so the test can SIGSTOP the
process there (its lease heartbeat stops with it), let another job take the step over, SIGCONT
it and release its remaining writes with a line on stdin. What became of the save goes to
``OUT/result.json``."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

from trainer_hooks import Checkpointer


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"t": {f"w{i}": torch.randn(32, 32, generator=g) for i in range(4)}, "seed": seed}


def main(root: str, job_id: str, seed: int, step: int, out: Path) -> None:
    ck = Checkpointer(root, job_id=job_id)
    real = ck.store.put_new
    first = threading.Lock()
    held = []

    def put_new(key, data):
        if "/arrays/" in key and "/c/" in key and first.acquire(blocking=False):  # a shard, not a zarr.json
            held.append(key)
            (out / "writing").write_text(key)
            sys.stdin.readline()  # held here (a slow disk, a GC pause) until the test says go
        return real(key, data)

    ck.store.put_new = put_new
    try:
        exc = ck.save(step, state(seed)).exception(timeout=300)
    except Exception as e:  # noqa: BLE001 - refused on the spot: recorded like a failure
        exc = e
    (out / "result.json").write_text(json.dumps({"error": None if exc is None else f"{type(exc).__name__}: {exc}"}))
    ck.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
