"""Entry point of one rank for interop_scenarios.py: ``interop_worker.py SCENARIO JSON_ARGS``
(the same contract as worker.py, which runs scenarios.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from tests.distributed import interop_scenarios  # noqa: E402


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = getattr(interop_scenarios, name)(**args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(args["out"], f"{name}.result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
