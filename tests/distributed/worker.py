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
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402


def main() -> None:
    # The toy models' tensors are all a few KiB, under the default size at which sharded tensors
    # are gathered into one shard: gather only the smallest (biases, norms, the gate), so every
    # scenario saves both layouts (many-shard weights, gathered small tensors).
    os.environ.setdefault("CKPTD_GATHER_SMALL_BYTES", "128")
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
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank is done before any tears its connections down: a peer closing while
            # gloo's threads still talk to it can abort the process at exit.
            dist.monitored_barrier(timeout=timedelta(seconds=120))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(args["out"], f"{name}.result{rank}.json").write_text(json.dumps(result))
    # The result is on disk; skip interpreter teardown, where native library destructors of
    # torch/gloo have been seen to call std::terminate ("terminate called without an active
    # exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
