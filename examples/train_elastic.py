"""Train ``TinyGPT`` with FSDP2 on CPU; stop on SIGTERM/SIGUSR1 and resume at any world size.

One script for every size: the same command resumes a job saved at N ranks on M ranks, because
``CheckpointHook.resume()`` restores the latest committed checkpoint (parameters and optimizer
state resharded for M) and the ``ElasticSampler`` in the state continues the epoch at its global
position. Under torchrun::

    torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29400 --rdzv-id=tinygpt \\
        examples/train_elastic.py --root s3://bucket/tinygpt

or on one machine ``python -m torch.distributed.run --standalone --nproc-per-node=2 ...``. The
ranks read RANK and WORLD_SIZE (and MASTER_ADDR/PORT) from the environment, as torchrun sets
them; ``elastic_demo.py`` starts them the same way without torchrun.

The global batch stays ``--global-batch`` at every world size (each rank takes
``global_batch / world_size`` samples per step), so a step trains on the same samples whatever
the size, and the loss curve does not depend on how often the job was resized.

Exit status after a stop signal: 0 on a rank that got the signal itself (its launcher is going
away). Under torchrun, a rank that stopped only because a *peer* got the signal (another node is
being preempted) exits with 75 instead, so that its torchrun agent counts the group as failed and
restarts it -- re-forming the job at the new size -- rather than counting it as finished
(``--max-restarts`` must allow it). With restarts, export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
restarted ranks can otherwise read the previous attempt's addresses from torchrun's shared
store and fail to connect (pytorch/pytorch#135712).

``--log-dir`` writes one JSON line per step and rank (step, world size, loss, the sample
indices trained on) to ``rank{R}.jsonl``, plus ``start``/``stop``/``done`` records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinygpt import CharDataset, GPTConfig, TinyGPT, shard  # noqa: E402

from trainer_hooks import Checkpointer, CheckpointHook, ElasticSampler, StatefulLoader  # noqa: E402

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped for a peer's preemption; restart me"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", help="job root URI (folder or s3://bucket/prefix); required unless --no-ckpt")
    p.add_argument(
        "--daemon",
        default=os.environ.get("CKPTD_DAEMON") or None,
        help="hand saves to this node's `ckptd serve` (URL; default $CKPTD_DAEMON); in-process if unset",
    )
    p.add_argument("--no-ckpt", action="store_true", help="train without checkpoints (a reference run)")
    p.add_argument("--log-dir", help="write per-step JSON lines here")
    p.add_argument("--samples", type=int, default=2400, help="samples per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=12, help="samples per step over all ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--every", type=int, default=50, help="save every N steps (0: only on a stop signal)")
    p.add_argument("--keep-last", type=int, default=None, help="retention: keep the newest K checkpoints")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (tests, demos)")
    args = p.parse_args(argv)
    if not args.no_ckpt and not args.root:
        p.error("--root is required (or --no-ckpt)")
    return args


class StepLog:
    def __init__(self, log_dir: str | None, rank: int):
        self._f = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(log_dir) / f"rank{rank}.jsonl", "a")  # noqa: SIM115 (kept for the run)

    def write(self, **record) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if args.global_batch % world:
        print(f"--global-batch {args.global_batch} does not split over {world} ranks", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if world > 1:
        dist.init_process_group("gloo")
    log = StepLog(args.log_dir, rank)
    try:
        code = train(args, rank, world, under_torchrun, log)
        _all_done()
        return code
    except SystemExit:
        _all_done()  # a coordinated stop: every rank saved the same step and leaves now
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _all_done() -> None:
    """Meet every rank before tearing gloo down: a peer closing its connections while another
    rank's gloo threads still use them has aborted processes at exit ("terminate called without
    an active exception"). Bounded, so a dead peer cannot hang the exit."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        except RuntimeError as e:
            print(f"warning: not every rank reached the end together: {e}", file=sys.stderr)


def train(args: argparse.Namespace, rank: int, world: int, under_torchrun: bool, log: StepLog) -> int:
    data = CharDataset(args.samples, args.seq_len, seed=1234)
    cfg = GPTConfig(data.vocab_size, args.seq_len, args.dim, args.layers, args.heads)
    torch.manual_seed(args.seed)  # the same full initial model on every rank, at every size
    model = TinyGPT(cfg)
    if world > 1:
        model = shard(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = ElasticSampler(len(data), shuffle=True, seed=args.seed)
    loader = StatefulLoader(torch.utils.data.DataLoader(data, batch_size=args.global_batch // world, sampler=sampler))
    state = {"model": model, "optim": optim, "sampler": sampler}

    ckpt = hook = None
    start = 0
    if not args.no_ckpt:
        ckpt = Checkpointer(args.root, daemon=args.daemon, keep_last=args.keep_last)
        hook = CheckpointHook(ckpt, state, every_n_steps=args.every or None, save_on_signal=True)
        start = hook.resume()
    log.write(
        event="start",
        rank=rank,
        world=world,
        step=start,
        position=sampler.position,
        epoch=sampler.epoch,
        pid=os.getpid(),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        t=time.time(),
    )
    if rank == 0:
        print(f"[rank 0/{world}] starting at step {start} (epoch {sampler.epoch}, position {sampler.position})")

    step = start
    try:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)  # the resumed epoch keeps its position
            for indices, x, y in loader:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                mean = loss.detach().clone()
                if world > 1:  # equal per-rank batches: the mean over ranks is the global mean
                    dist.all_reduce(mean)
                    mean /= world
                log.write(
                    event="step",
                    step=step,
                    rank=rank,
                    world=world,
                    loss=mean.item(),
                    indices=indices.tolist(),
                    t=time.time(),
                )
                if args.step_delay:
                    time.sleep(args.step_delay)
                if hook is not None:
                    hook.after_step(step)  # saves when due; after SIGTERM/SIGUSR1: saves, exits
                step += 1
        last = step - 1
        if hook is not None:
            if last >= 0 and hook.last_saved != last:
                ckpt.save(last, state).result()  # the end of training is always committed
            hook.close()
    except SystemExit as stop:
        signalled = hook is not None and hook.signalled is not None
        saved = hook.last_saved if hook is not None else None
        log.write(event="stop", rank=rank, world=world, step=saved, signalled=signalled)
        if rank == 0:
            print(f"[rank 0/{world}] stop requested: saved step {saved}, exiting")
        if under_torchrun and not signalled and stop.code == 0:
            raise SystemExit(RESTART_EXIT_CODE) from None
        raise
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the last commit
    log.write(event="done", rank=rank, world=world, step=last)
    if rank == 0:
        print(f"[rank 0/{world}] done: trained to step {last}")
    return 0


def _exit(code: int | str | None) -> None:
    """Leave without interpreter teardown: after a clean run (barrier, ``destroy_process_group``,
    last commit waited for) torch/gloo's native destructors have still aborted rank 0 now and then
    at exit ("terminate called without an active exception", SIGABRT), failing a finished job."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        _exit(main())
    except SystemExit as stop:
        _exit(stop.code)
