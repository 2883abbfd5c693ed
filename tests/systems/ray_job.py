"""One Ray Train run of ``exact_train``'s training on CPU (gloo), for tests/systems/test_ray.py.

    python -m tests.systems.ray_job --root ROOT --run 4:7 --run 3 --log-dir D --storage DIR
                                    [--final PATH] [--elastic MIN-MAX]

One local Ray cluster (``ray.init``), then one ``TorchTrainer.fit`` per ``--run WORKERS[:STOP]``,
in order. With ``--elastic MIN-MAX`` every fit gets the same elastic
``ScalingConfig(num_workers=(MIN, MAX))`` and its own cluster of WORKERS CPUs (a cluster that
shrank between runs): Ray, not the script, picks the worker count. Each fit's
``train_loop_per_worker`` uses ``RayCheckpointHook``, ``Checkpointer`` and ``ElasticSampler``
unchanged, resumes from the root's latest committed step, and either trains to the end of the
epoch or saves step STOP, reports it and returns (the run stops there). Prints one JSON line
per fit: what ``Result.checkpoint`` points at, and the metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train_loop_per_worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from tests.systems import exact_train as ex
    from trainer_hooks import Checkpointer, ElasticSampler
    from trainer_hooks.ray import RayCheckpointHook

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = ex.dataset(config["samples"])
    model, optim = ex.build()
    sampler = ElasticSampler(config["samples"], shuffle=True, seed=0)
    state = {"model": model, "optim": optim, "sampler": sampler}
    hook = RayCheckpointHook(Checkpointer(config["root"]), state, every_n_steps=config["every"])
    step = hook.resume()
    log = open(Path(config["log_dir"]) / f"rank{rank}-w{world}.jsonl", "a")  # noqa: SIM115
    log.write(json.dumps({"event": "start", "step": step, "rank": rank, "world": world}) + "\n")
    per_rank = config["global_batch"] // world
    it = iter(sampler)
    while True:
        batch = [i for _, i in zip(range(per_rank), it, strict=False)]
        more = torch.tensor([len(batch)])
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if more.item() == 0:
            break
        loss = ex.exact_step(model, optim, batch, x, y)
        log.write(json.dumps({"event": "step", "step": step, "rank": rank, "world": world, "indices": batch}) + "\n")
        log.flush()
        if config["stop_after"] is not None and step == config["stop_after"]:
            hook.save_now(step)  # the run stops here: committed and reported
            hook.close()
            return
        hook.after_step(step, metrics={"loss": loss})
        step += 1
    last = step - 1
    if hook.last_saved != last:
        hook.save_now(last)
    hook.close()
    hook.ckpt.close()
    if rank == 0 and config["final"]:
        torch.save(ex.final_tensors(model, optim), config["final"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", action="append", required=True, help="WORKERS[:STOP]")
    p.add_argument("--elastic", help="MIN-MAX: ScalingConfig(num_workers=(MIN, MAX)), WORKERS CPUs per run")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--final")
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()

    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tests import load
    from trainer_hooks.ray import ckptd_step

    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = [(int(r.split(":")[0]), int(r.split(":")[1]) if ":" in r else None) for r in args.run]
    elastic = tuple(int(n) for n in args.elastic.split("-")) if args.elastic else None

    def start(cpus: int) -> None:
        def init() -> None:
            ray.init(num_cpus=cpus, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True)

        def transient(e: object) -> bool:  # Ray gives its raylet a fixed 30 s to register (ray._private.node)
            if isinstance(e, Exception) and "timed out during startup" in str(e):
                ray.shutdown()  # the half-started cluster's processes, before the next try
                return True
            return False

        load.retry(init, transient, "ray.init")

    if not elastic:
        start(max(w for w, _ in runs))
    for workers, stop_after in runs:
        if elastic:
            start(workers)  # the cluster this fit finds: Ray sizes the worker group to it
        num_workers = elastic or workers
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "root": args.root,
                "samples": args.samples,
                "global_batch": args.global_batch,
                "every": args.every,
                "stop_after": stop_after,
                "log_dir": args.log_dir,
                "final": args.final if stop_after is None else None,
            },
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False),
            run_config=RunConfig(
                name=f"exact-{workers}-{int(time.time() * 1000)}",
                storage_path=args.storage,
                checkpoint_config=CheckpointConfig(num_to_keep=3),
            ),
        )
        result = trainer.fit()
        record = {
            "workers": workers,
            "checkpoint": ckptd_step(result.checkpoint),
            "metrics": {k: v for k, v in (result.metrics or {}).items() if k in ("ckptd_step", "loss")},
            "best": [ckptd_step(c) for c, _ in (result.best_checkpoints or [])],
        }
        print("RESULT " + json.dumps(record), flush=True)
        if elastic:
            ray.shutdown()
    if not elastic:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
