"""A training run whose final state does not depend on the world size, bit for bit.

Used by the scheduler tests (Slurm, Ray Train, ...) to check "stopped at N ranks, resumed at M:
the final state is *bitwise* equal to an uninterrupted reference run". Ordinary data-parallel
training cannot give that: an all-reduce over N ranks sums the gradients in another order than
one over M ranks, so the weights drift apart in the last bits. Here every rank computes the
gradient of each of its samples on its own (a batch of one: the same kernels whatever the rank),
the ranks all-gather those per-sample gradients with their sample indices, and every rank sums
them in the order of the sample indices. The sum, the AdamW step and so the weights are then the
same bits at every world size and every split of the epoch into allocations. What remains to be
tested is exactly what ckptd must get right: the model, the optimizer moments and the data
position restored bitwise, and every sample of the epoch trained on once.

Command line (the flags of ``examples/train_elastic.py`` that the deploy recipes pass, so a
recipe runs it with ``TRAIN=tests/systems/exact_train.py``)::

    exact_train.py --root ROOT [--daemon URL] [--global-batch 12] [--every 10] [--samples 480]
                   [--log-dir DIR] [--final PATH] [--step-delay S]

Rank and world size come from RANK/WORLD_SIZE (torchrun, or the Slurm task variables when
started by ``srun`` directly). ``--log-dir`` (or EXACT_LOG_DIR) gets one JSON line per step and
rank with the sample indices; ``--final`` (or EXACT_FINAL) gets the final model and optimizer
tensors (``torch.save``, written by rank 0 after the last step). EXACT_STEP_DELAY slows each step
down. EXACT_HOLD_FILE makes a test deterministic: while that file exists and holds a step number
S, each rank waits after training step S (and any later one) until it gets a stop signal or the
file changes, so a test can stop the job at a step it chose, whatever the machine's speed.
Exit status after a stop signal: 0.
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

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script by torchrun or srun
    sys.path.insert(0, str(REPO))

from tests.local_launch import exit_after  # noqa: E402
from trainer_hooks import Checkpointer, CheckpointHook, ElasticSampler  # noqa: E402

DIM_IN, DIM_HIDDEN, DIM_OUT = 8, 16, 4


def dataset(samples: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, DIM_IN, generator=g)
    y = torch.randn(samples, DIM_OUT, generator=g)
    return x, y


def build(seed: int = 0, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every rank (a full replica: no sharding)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM_IN, DIM_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(DIM_HIDDEN, DIM_OUT)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, optim


def exact_step(
    model: torch.nn.Module, optim: torch.optim.Optimizer, indices: list[int], x: torch.Tensor, y: torch.Tensor
) -> float:
    """One optimizer step on the global batch whose local part is ``indices``; collective.
    Returns the mean loss of the global batch (the same bits on every rank)."""
    params = [p for p in model.parameters()]
    grads, losses = [], []
    for i in indices:
        loss = torch.nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1])
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        losses.append(loss.detach().reshape(1))
    local = torch.stack(grads) if grads else torch.zeros(0, sum(p.numel() for p in params))
    idx = torch.tensor(indices, dtype=torch.int64)
    loss_t = torch.cat(losses) if losses else torch.zeros(0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        idx, local, loss_t = _gather(idx, local, loss_t)
    order = torch.argsort(idx)
    total = torch.zeros(local.shape[1])
    mean_loss = torch.zeros(())
    for k in order.tolist():  # a fixed order: the sample index, never the rank
        total = total + local[k]
        mean_loss = mean_loss + loss_t[k]
    total = total / len(order)
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return (mean_loss / len(order)).item()


def _gather(idx: torch.Tensor, grads: torch.Tensor, losses: torch.Tensor):
    """All-gather rows of possibly different counts (the epoch's tail) from every rank."""
    world = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([idx.numel()]))
    most = int(max(c.item() for c in counts))
    width = grads.shape[1]

    def padded(t: torch.Tensor, shape: tuple) -> torch.Tensor:
        out = torch.zeros(shape, dtype=t.dtype)
        out[: t.shape[0]] = t
        return out

    parts = []
    for t, shape in ((idx, (most,)), (grads, (most, width)), (losses, (most,))):
        bufs = [torch.zeros(shape, dtype=t.dtype) for _ in range(world)]
        dist.all_gather(bufs, padded(t, shape))
        parts.append(torch.cat([b[: int(c.item())] for b, c in zip(bufs, counts, strict=True)]))
    return tuple(parts)


def final_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and every optimizer tensor (moments, step counts), flat-keyed."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = torch.as_tensor(v).clone()
    return out


def _hold(step: int, hook: CheckpointHook) -> None:
    """Wait here while EXACT_HOLD_FILE says to (see the module docstring)."""
    path = os.environ.get("EXACT_HOLD_FILE")
    while path and hook.signalled is None:
        try:
            held = int(Path(path).read_text().strip() or -1)
        except (FileNotFoundError, ValueError):
            return
        if step < held:
            return
        time.sleep(0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--daemon", default=os.environ.get("CKPTD_DAEMON") or None, help="ckptd serve URL")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--samples", type=int, default=int(os.environ.get("EXACT_SAMPLES", "480")))
    p.add_argument("--log-dir", default=os.environ.get("EXACT_LOG_DIR"))
    p.add_argument("--final", default=os.environ.get("EXACT_FINAL"))
    p.add_argument("--step-delay", type=float, default=float(os.environ.get("EXACT_STEP_DELAY", "0")))
    return p.parse_args(argv)


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return default


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    if args.global_batch % world:
        print(f"--global-batch {args.global_batch} does not split over {world} ranks", file=sys.stderr)
        return 2
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    log = None
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.log_dir) / f"rank{rank}.jsonl", "a")  # noqa: SIM115 (kept for the run)

    def write(**record) -> None:
        if log is not None:
            log.write(json.dumps({**record, "rank": rank, "world": world, "pid": os.getpid()}) + "\n")
            log.flush()

    x, y = dataset(args.samples)
    model, optim = build()
    sampler = ElasticSampler(args.samples, shuffle=True, seed=0)
    state = {"model": model, "optim": optim, "sampler": sampler}
    ckpt = Checkpointer(args.root, daemon=args.daemon)
    hook = CheckpointHook(ckpt, state, every_n_steps=args.every or None, save_on_signal=True)
    try:
        step = hook.resume()
        write(event="start", step=step, position=sampler.position, t=time.time())
        per_rank = args.global_batch // world
        it = iter(sampler)
        while True:
            batch = [i for _, i in zip(range(per_rank), it, strict=False)]
            # every rank agrees whether the epoch has ended (the last round may be uneven)
            more = torch.tensor([len(batch)])
            if world > 1:
                dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if more.item() == 0:
                break
            loss = exact_step(model, optim, batch, x, y)
            write(event="step", step=step, indices=batch, loss=loss, t=time.time())
            if args.step_delay:
                time.sleep(args.step_delay)
            _hold(step, hook)
            hook.after_step(step)
            step += 1
        last = step - 1
        if hook.last_saved != last:
            ckpt.save(last, state).result()  # the end of training is always committed
        hook.close()
        if rank == 0 and args.final:
            torch.save(final_tensors(model, optim), args.final)
        write(event="done", step=last)
        return 0
    except SystemExit as stop:
        write(event="stop", step=hook.last_saved, signalled=hook.signalled)
        raise SystemExit(stop.code) from None
    finally:
        ckpt.close()
        if dist.is_initialized():
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            except RuntimeError as e:
                print(f"warning: not every rank reached the end together: {e}", file=sys.stderr)
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_after(main)
