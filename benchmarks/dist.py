"""Run a function of ``benchmarks.reshard_scenarios`` in N real processes (gloo on CPU), the way
torchrun would: ``python -m benchmarks.dist SCENARIO JSON_ARGS`` is one rank, with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. Each rank writes its result as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.local_launch import exit_after, spawn_ranks, wait_ok

ROOT = Path(__file__).resolve().parents[1]


def run(world: int, scenario: str, out: Path, timeout: float = 900, **args) -> list[dict]:
    argv = [sys.executable, "-m", "benchmarks.dist", scenario, json.dumps({**args, "out": str(out)})]

    name = scenario.replace(":", ".")

    def log(rank: int) -> Path:
        return out / f"{name}.w{world}.rank{rank}.log"

    procs = spawn_ranks(world, argv, log, cwd=ROOT, pythonpath=ROOT, extra_env={"PYTHONWARNINGS": "ignore"})
    try:
        wait_ok(procs, timeout, log, f"{scenario} at {world} ranks")
    except AssertionError as e:  # a benchmark section reports a RuntimeError
        raise RuntimeError(str(e)) from None
    return [json.loads((out / f"{name}.w{world}.result{r}.json").read_text()) for r in range(world)]


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
        if ":" in name:  # module:function (e.g. benchmarks.tier_scenarios:restore)
            import importlib

            module, name = name.split(":", 1)
            result = getattr(importlib.import_module(module), name)(**args)
        else:
            result = getattr(reshard_scenarios, name)(**args)
    finally:
        dist.destroy_process_group()
    Path(args["out"], f"{sys.argv[1].replace(':', '.')}.w{world}.result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    exit_after(main)
