"""Run a function of ``benchmarks.reshard_scenarios`` in N real processes (gloo on CPU), the way
torchrun would: ``python -m benchmarks.dist SCENARIO JSON_ARGS`` is one rank, with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. Each rank writes its result as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.local_launch import spawn_ranks, wait_ranks

ROOT = Path(__file__).resolve().parents[1]


def run(world: int, scenario: str, out: Path, timeout: float = 900, **args) -> list[dict]:
    argv = [sys.executable, "-m", "benchmarks.dist", scenario, json.dumps({**args, "out": str(out)})]
    procs = spawn_ranks(
        world,
        argv,
        lambda rank: out / f"{scenario}.w{world}.rank{rank}.log",
        cwd=ROOT,
        pythonpath=ROOT,
        extra_env={"PYTHONWARNINGS": "ignore"},
    )
    try:
        codes = wait_ranks(procs, timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{scenario} at {world} ranks timed out\n{_logs(out, scenario, world)}") from None
    if any(codes):
        raise RuntimeError(f"{scenario} at {world} ranks: exit codes {codes}\n{_logs(out, scenario, world)}")
    return [json.loads((out / f"{scenario}.w{world}.result{r}.json").read_text()) for r in range(world)]


def _logs(out: Path, scenario: str, world: int) -> str:
    parts = []
    for r in range(world):
        f = out / f"{scenario}.w{world}.rank{r}.log"
        if f.exists():
            parts.append(f"--- rank {r} ---\n" + f.read_text()[-3000:])
    return "\n".join(parts)


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from benchmarks import reshard_scenarios

    name, args = sys.argv[1], json.loads(sys.argv[2])
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = getattr(reshard_scenarios, name)(**args)
    finally:
        dist.destroy_process_group()
    Path(args["out"], f"{name}.w{world}.result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
