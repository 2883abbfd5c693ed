"""Entry point of one rank: ``worker.py MODULE SCENARIO JSON_ARGS`` (see launch.py) runs
``MODULE.SCENARIO(**JSON_ARGS)`` and writes its JSON result to ``OUT/SCENARIO.resultRANK.json``.
MODULE is ``tests.distributed.scenarios``, ``tests.distributed.interop_scenarios`` or
``tests.server.daemon_scenarios``; one that sets ``LOG_LEVEL`` gets logging at that level."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402


def main() -> None:
    module, name, args = importlib.import_module(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    level = getattr(module, "LOG_LEVEL", None)
    if level is not None:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 or args.get("dist"):
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = getattr(module, name)(**args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(args["out"], f"{name}.result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
