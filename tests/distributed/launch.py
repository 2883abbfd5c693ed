"""Run a scenario in N real processes (gloo on CPU), the way torchrun would.

Each rank is a separate ``python tests/distributed/worker.py MODULE SCENARIO JSON_ARGS`` process
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment; MODULE holds the scenarios
(``tests.distributed.scenarios`` unless told otherwise); a world of 1 runs without a process group.
Processes are real so that tests can kill them with SIGKILL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.local_launch import free_port, log_tails, spawn_ranks, wait_ok

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
SCENARIOS = "tests.distributed.scenarios"

__all__ = ["ROOT", "WORKER", "SCENARIOS", "free_port", "spawn", "wait", "logs", "run"]


def spawn(
    world: int,
    scenario: str,
    args: dict,
    out: Path,
    extra_env: dict | None = None,
    scenarios: str = SCENARIOS,
) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``scenarios.scenario(**args, out=out)``; logs and results go to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return spawn_ranks(
        world,
        [sys.executable, str(WORKER), scenarios, scenario, json.dumps({**args, "out": str(out)})],
        lambda rank: out / f"{scenario}.rank{rank}.log",
        cwd=ROOT,
        pythonpath=ROOT,
        extra_env=extra_env,
    )


def wait(procs: list[subprocess.Popen], out: Path, scenario: str, timeout: float = 240) -> list[dict]:
    wait_ok(procs, timeout, lambda r: out / f"{scenario}.rank{r}.log", scenario)
    return [json.loads((out / f"{scenario}.result{r}.json").read_text()) for r in range(len(procs))]


def logs(out: Path, scenario: str, world: int) -> str:
    return log_tails(lambda r: out / f"{scenario}.rank{r}.log", world)


def run(
    world: int,
    scenario: str,
    out: Path,
    timeout: float = 240,
    extra_env: dict | None = None,
    scenarios: str = SCENARIOS,
    **args,
) -> list[dict]:
    return wait(spawn(world, scenario, args, out, extra_env, scenarios), out, scenario, timeout)
