"""A Horovod training loop with ckptd, for tests/systems/test_horovod.py.

    horovodrun -np 2 --gloo python tests/systems/hvd_train.py --root ROOT --out DIR [--stop-at S]

Horovod as its users write it: ``hvd.init()``, ``hvd.DistributedOptimizer`` around AdamW (the
gradient all-reduce through Horovod's gloo), plus ``trainer_hooks.horovod``: the torch.distributed
group formed from Horovod's ranks, ``resume`` (restore, or Horovod's broadcast from rank 0 on a
fresh start) and an ``ElasticSampler`` dealing the epoch over ``hvd.size()`` ranks. Each rank
seeds its model differently on purpose: on a fresh start only the broadcast makes them replicas.

Writes to DIR: ``rank{R}.jsonl`` (one line per step: step, world, rank, sample indices),
``resumed-w{W}-r{R}.pt`` (the rank's model and optimizer tensors right after ``resume``) and, at
``--stop-at S``, ``saved-w{W}-r{R}.pt`` (the same after step S is saved and committed; then exit 0).
``CKPTD_HVD_NO_GROUP=1`` skips ``init_process_group`` (to see what ckptd does without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script by horovodrun
    sys.path.insert(0, str(REPO))

from tests.local_launch import exit_after  # noqa: E402
from trainer_hooks import Checkpointer, ElasticSampler  # noqa: E402
from trainer_hooks.horovod import init_process_group, resume  # noqa: E402


def tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = torch.as_tensor(v).clone()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--stop-at", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    if os.environ.get("CKPTD_HVD_NO_GROUP") != "1":
        init_process_group()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(args.samples, 8, generator=g), torch.randn(args.samples, 4, generator=g)
    torch.manual_seed(100 + rank)  # replicas only through resume's broadcast (or the restore)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optim = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), named_parameters=model.named_parameters()
    )
    sampler = ElasticSampler(args.samples, shuffle=True, seed=0, rank=rank, num_replicas=world)
    state = {"model": model, "optim": optim, "sampler": sampler}
    with Checkpointer(args.root) as ck:
        step = resume(ck, state)
        torch.save(tensors(model, optim), out / f"resumed-w{world}-r{rank}.pt")
        per_rank = args.global_batch // world
        it = iter(sampler)
        with open(out / f"rank{rank}.jsonl", "a") as log:
            while True:
                batch = [i for _, i in zip(range(per_rank), it, strict=False)]
                if not batch:  # samples % global batch == 0: every rank runs out at once
                    break
                optim.zero_grad()
                torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
                optim.step()  # Horovod's all-reduce of the gradients, then AdamW
                log.write(json.dumps({"step": step, "world": world, "rank": rank, "indices": batch}) + "\n")
                log.flush()
                if step == args.stop_at:
                    ck.save(step, state).result()  # committed by every rank
                    torch.save(tensors(model, optim), out / f"saved-w{world}-r{rank}.pt")
                    return 0
                step += 1
    torch.save(tensors(model, optim), out / f"final-w{world}-r{rank}.pt")
    return 0


if __name__ == "__main__":
    exit_after(main)
