"""What each rank does in the distributed tests. Every function runs on every rank of a world
started by launch.py and returns a JSON-able result (rank 0's is usually the interesting one)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from trainer_hooks import Checkpointer

VOCAB, DIM, HIDDEN, BATCH, SEQ = 37, 16, 24, 12, 5


class Tiny(nn.Module):
    """A GPT-shaped toy whose vocabulary (37) splits unevenly over 2, 3 and 4 ranks, and whose
    3-element ``gate`` leaves a rank with an empty FSDP block at 4 ranks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.gate = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = self.emb(x)
        h = torch.cat([h[..., :3] * self.gate, h[..., 3:]], dim=-1)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.out(self.norm(h))


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def build(layout: str, seed: int):
    """The model wrapped for ``layout``; returns (model, dp_rank, dp_size)."""
    rank, ws = world()
    torch.manual_seed(seed)
    model = Tiny()
    if layout == "single":
        assert ws == 1
        return model, 0, 1
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), rank, ws
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (ws,))
        for m in (model.emb, model.fc1, model.fc2, model.out):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rank, ws
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
        "out": ColwiseParallel(output_layouts=Replicate()),
    }
    if layout == "tp":
        mesh = init_device_mesh("cpu", (ws,))
        parallelize_module(model, mesh, plan)
        return model, 0, 1
    if layout == "2d":
        assert ws % 2 == 0
        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        for m in (model.emb, model.fc1, model.fc2, model.out):
            fully_shard(m, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh.get_coordinate()[0], ws // 2
    raise ValueError(layout)


def make_state(layout: str, seed: int):
    model, dp_rank, dp_size = build(layout, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(seed)
    extra = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 1000, (4,), generator=g),
        "flag": torch.rand(6, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 3),
        "f16": torch.randn(2, 2, generator=g).half(),
        # 6 MiB: over 1 MiB, so it is chunked and staged as an object image (by the one rank
        # that writes a replicated tensor); everything else here takes the plain buffer path
        "big": torch.randn(1537, 1024, generator=g),
    }
    state = {"model": model, "optim": optim, "sched": sched, "extra": extra, "meta": {"seed": seed}}
    return state, dp_rank, dp_size


def batch(step: int, dp_rank: int, dp_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x[dp_rank::dp_size], y[dp_rank::dp_size]


def train_step(state, step: int, dp_rank: int, dp_size: int) -> float:
    model, optim = state["model"], state["optim"]
    x, y = batch(step, dp_rank, dp_size)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
    state["sched"].step()
    # the global loss: the mean over all ranks (tensor-parallel peers hold equal values), so it
    # is the mean over data-parallel ranks, identical on every rank
    t = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def full_state(state) -> dict:
    """Every parameter and optimizer state as full tensors (rank 0 gets them)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = state["model"], state["optim"]
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optim, options=opts)
    out = {f"model/{k}": v for k, v in msd.items()}
    for fqn, s in osd.get("state", {}).items():
        for k, v in s.items():
            out[f"optim/{fqn}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    for k, v in state["extra"].items():
        out[f"extra/{k}"] = v
    return out


def save_reference(state, layout: str, out: str) -> None:
    """Record the full state (collective) as ``ref_{layout}_{world size}.pt`` in ``out``; rank 0
    writes it."""
    ref = full_state(state)
    rank, ws = world()
    if rank == 0:
        torch.save(ref, Path(out) / f"ref_{layout}_{ws}.pt")


def compare_with_reference(state, out: str, ref: str) -> list[str]:
    """The full state (collective) against the reference ``out/ref``, bitwise: on rank 0 the keys
    whose dtype, shape or bits differ (and a line if the key sets differ); [] on the others."""
    got = full_state(state)
    mismatches: list[str] = []
    if world()[0] == 0:
        expect = torch.load(Path(out) / ref)
        if set(expect) != set(got):
            mismatches.append(f"keys differ: {sorted(set(expect) ^ set(got))}")
        for k in sorted(set(expect) & set(got)):
            a, b = expect[k], got[k]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                mismatches.append(k)
    return mismatches


def replicas_disagree(state) -> list[str]:
    """Plain (replicated) tensors must be identical on every rank: the full-state gather above
    only shows rank 0's copy of them."""
    from trainer_hooks.sharding import is_dtensor

    sd = {**{f"model/{k}": v for k, v in get_model_state_dict(state["model"]).items()}}
    for fqn, s in get_optimizer_state_dict(state["model"], state["optim"]).get("state", {}).items():
        sd.update({f"optim/{fqn}/{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    sd.update({f"extra/{k}": v for k, v in state["extra"].items()})
    mine = {k: v.detach().clone() for k, v in sd.items() if not is_dtensor(v)}
    if not dist.is_initialized():
        return []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bad = []
    for k, v in mine.items():
        if not all(torch.equal(v, other[k]) for other in everyone):
            bad.append(f"{k} differs between ranks")
    return bad


def save(layout: str, roots: list[str], out: str, steps: int = 2, seed: int = 0) -> dict:
    """Train ``steps`` steps, save after the last one to every root, record the full state, then
    train one more step and record its loss (the uninterrupted reference)."""
    state, dp_rank, dp_size = make_state(layout, seed)
    losses = [train_step(state, s, dp_rank, dp_size) for s in range(steps)]
    saved = steps - 1
    for root in roots:
        ck = Checkpointer(root)
        ck.save(saved, state).result()
        ck.close()
    save_reference(state, layout, out)
    next_loss = train_step(state, steps, dp_rank, dp_size)
    return {"losses": losses, "next_loss": next_loss, "saved_step": saved}


def restore(layout: str, root: str, out: str, ref: str, seed: int = 123, in_place: bool = False) -> dict:
    """Restore into a differently initialised state; compare with ``ref`` bitwise; one step."""
    state, dp_rank, dp_size = make_state(layout, seed)
    ck = Checkpointer(root)
    step = ck.restore(state, in_place=in_place)
    ck.close()
    mismatches = compare_with_reference(state, out, ref)
    mismatches += replicas_disagree(state)
    next_loss = train_step(state, step + 1, dp_rank, dp_size)
    return {
        "step": step,
        "mismatches": mismatches,
        "next_loss": next_loss,
        "sched_last_epoch": state["sched"].last_epoch,
        "meta": state["meta"],
    }


def save_then_hang(root: str, out: str, delay: float = 0.5) -> dict:
    """Commit step 1, then start a save of step 2 whose puts are slowed down (an injected
    fault: a slow disk), say so in a file and wait to be killed."""
    state, dp_rank, dp_size = make_state("fsdp" if world()[1] > 1 else "single", 0)
    ck = Checkpointer(root)
    train_step(state, 0, dp_rank, dp_size)
    ck.save(1, state).result()
    train_step(state, 1, dp_rank, dp_size)
    real_put = ck.store.put_new  # how the writer puts data (create-only, made durable by one sync)

    def slow_put(key, data):
        time.sleep(delay)
        return real_put(key, data)

    ck.store.put_new = slow_put
    ck.save(2, state)
    Path(out, f"save_returned_{world()[0]}").write_text("1")
    time.sleep(600)
    return {}


def env_info(out: str) -> dict:
    return {"pid": os.getpid(), "world": world()}
