"""Run a scenario in N real processes (gloo on CPU), the way torchrun would.

Each rank is a separate ``python tests/distributed/worker.py`` process with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment; a world of 1 runs without a process group.
Processes are real so that tests can kill them with SIGKILL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, scenario: str, args: dict, out: Path, extra_env: dict | None = None) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **(extra_env or {}),
        }
        with open(out / f"{scenario}.rank{rank}.log", "w") as log:  # the child keeps its own fd
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, json.dumps({**args, "out": str(out)})],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(ROOT),
                )
            )
    return procs


def wait(procs: list[subprocess.Popen], out: Path, scenario: str, timeout: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{scenario}: timed out\n{logs(out, scenario, len(procs))}") from None
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{scenario}: exit codes {codes}\n{logs(out, scenario, len(procs))}")
    return [json.loads((out / f"{scenario}.result{r}.json").read_text()) for r in range(len(procs))]


def logs(out: Path, scenario: str, world: int) -> str:
    parts = []
    for r in range(world):
        f = out / f"{scenario}.rank{r}.log"
        if f.exists():
            parts.append(f"--- rank {r} ---\n" + f.read_text()[-4000:])
    return "\n".join(parts)


def run(
    world: int, scenario: str, out: Path, timeout: float = 240, extra_env: dict | None = None, **args
) -> list[dict]:
    return wait(spawn(world, scenario, args, out, extra_env), out, scenario, timeout)
