"""Ranks for ``test_users.py``: what users train with that the other scenarios lack. Run by
``launch.py`` (``scenarios=`` this module).

- ``float8_save``/``float8_restore``: DTensors of every float8 dtype (and float4_e2m1fn_x2),
  sharded on dimension 0 unevenly (37 rows), one small enough to be gathered into one shard
  over gloo, and an FSDP2 module whose weight is float8; every bit pattern, NaNs included.
- ``zero_save``/``zero_restore``: DDP + ``ZeroRedundancyOptimizer(Adam)`` with two parameter
  groups, trained a few steps; the optimizer state is compared bitwise with the state
  ``consolidate_state_dict`` gathers (torch's own view of the whole ZeRO state).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer_hooks import Checkpointer

NAMES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def bits(name: str, shape, seed: int) -> torch.Tensor:
    """Every byte value (permutations of 0..255, tiled) as dtype ``name``; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    b = torch.cat([torch.randperm(256, generator=g) for _ in range(-(-n // 256))])[:n]
    return b.to(torch.uint8).reshape(shape).view(getattr(torch, name))


def _fp8_full() -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(NAMES):
        out[name] = bits(name, (37, 16), seed=i)  # 592 bytes: sharded (over 128, see worker.py)
        out[f"{name}_small"] = bits(name, (5, 4), seed=50 + i)  # 20 bytes: gathered into one shard
    return out


def _sharded(full: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Shard

    rank, ws = world()
    local = full.chunk(ws)[rank] if rank < len(full.chunk(ws)) else full[:0]
    return DTensor.from_local(
        local.contiguous(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def _fp8_module(seed: int):
    from torch.distributed.fsdp import fully_shard

    m = nn.Linear(16, 37, bias=False)
    with torch.no_grad():
        m.weight = nn.Parameter(bits("float8_e4m3fn", (37, 16), seed=seed), requires_grad=False)
    if world()[1] > 1:
        fully_shard(m)
    return m


def _fp8_state(zero: bool):
    full = _fp8_full()
    if zero:
        full = {k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in full.items()}
    _, ws = world()
    if ws > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ws,))
        tensors = {k: _sharded(v, mesh) for k, v in full.items()}
    else:
        tensors = full
    return {"fp8": tensors, "model": _fp8_module(seed=99 if not zero else 7)}


def float8_save(root: str, out: str) -> dict:
    state = _fp8_state(zero=False)
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    return {"placements": {k: str(getattr(v, "placements", "")) for k, v in state["fp8"].items()}}


def float8_restore(root: str, out: str) -> dict:
    """Restore into zeroed tensors (sharded as this world size shards them); every rank checks
    its own block against the expected bits."""
    from trainer_hooks.sharding import local_tensor

    state = _fp8_state(zero=True)
    with Checkpointer(root) as ck:
        step = ck.restore(state)
    rank, ws = world()
    mismatches = []
    for k, want in _fp8_full().items():
        got = state["fp8"][k]
        mine = want.chunk(ws)[rank] if ws > 1 else want
        lt = local_tensor(got)
        if (
            lt.dtype != want.dtype
            or lt.shape != mine.shape
            or not torch.equal(lt.view(torch.uint8), mine.view(torch.uint8))
        ):
            mismatches.append(k)
    w = local_tensor(state["model"].weight)
    want = bits("float8_e4m3fn", (37, 16), seed=99)
    want = want.chunk(ws)[rank] if ws > 1 else want
    if w.dtype != want.dtype or not torch.equal(w.view(torch.uint8), want.view(torch.uint8)):
        mismatches.append("model/weight")
    return {"step": step, "mismatches": mismatches, "checked": len(_fp8_full()) + 1}


# ------------------------------------------------------------------------------ ZeRO


def _zero_state(seed: int, bucket_view: bool = False):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3))
    model = DDP(net)
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in net.named_parameters() if n.endswith("bias")]
    optim = ZeroRedundancyOptimizer(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        optimizer_class=torch.optim.Adam,
        lr=1e-2,
        foreach=False,
        parameters_as_bucket_view=bucket_view,
    )
    return {"model": model, "optim": optim}


def _zero_train(state, step: int) -> float:
    """One step on the global batch of ``step``; each rank takes its share of its 12 rows (the
    mean over ranks is the mean over the batch for 1, 2 and 3 ranks)."""
    rank, ws = world()
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
    x, y = x[rank::ws], y[rank::ws]
    loss = nn.functional.cross_entropy(state["model"](x), y)
    state["optim"].zero_grad(set_to_none=True)
    loss.backward()
    state["optim"].step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t / ws)


def _consolidated(state) -> dict | None:
    """torch's own view of the whole ZeRO state (collective): the state dict on rank 0, else None."""
    optim = state["optim"]
    optim.consolidate_state_dict(to=0)
    if world()[0] != 0:
        return None
    sd = optim.state_dict()
    return {
        "state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]],
        "params": {k: v.detach().clone() for k, v in state["model"].module.state_dict().items()},
    }


def _differences(want: dict, got: dict) -> list[str]:
    out = []
    if set(want["state"]) != set(got["state"]):
        out.append(f"params with state differ: {sorted(want['state'])} vs {sorted(got['state'])}")
    for i in sorted(set(want["state"]) & set(got["state"])):
        a, b = want["state"][i], got["state"][i]
        if set(a) != set(b):
            out.append(f"state {i}: keys {sorted(a)} vs {sorted(b)}")
        for k in set(a) & set(b):
            x, y = a[k], b[k]
            if torch.is_tensor(x):
                if not torch.is_tensor(y) or x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    out.append(f"state {i}/{k}")
            elif x != y:
                out.append(f"state {i}/{k}: {x!r} vs {y!r}")
    if want["param_groups"] != got["param_groups"]:
        out.append(f"param_groups: {want['param_groups']} vs {got['param_groups']}")
    for k, v in want["params"].items():
        if not torch.equal(v, got["params"][k]):
            out.append(f"param {k}")
    return out


def zero_save(root: str, out: str, steps: int = 3, dist: bool = True, bucket_view: bool = False) -> dict:
    state = _zero_state(seed=0, bucket_view=bucket_view)
    losses = [_zero_train(state, s) for s in range(steps)]
    with Checkpointer(root) as ck:
        ck.save(steps - 1, state).result()
    ref = _consolidated(state)
    next_loss = _zero_train(state, steps)
    after = _consolidated(state)
    if ref is not None:
        torch.save({"at_save": ref, "after_next": after}, Path(out) / "zero_ref.pt")
    return {"losses": losses, "next_loss": next_loss}


def zero_restore(root: str, out: str, dist: bool = True, in_place: bool = False, bucket_view: bool = False) -> dict:
    """Restore into a differently initialised DDP + ZeRO at this world size; compare with the
    consolidated reference bitwise; then one more step, compared with the uninterrupted run."""
    state = _zero_state(seed=123, bucket_view=bucket_view)
    with Checkpointer(root) as ck:
        step = ck.restore(state, in_place=in_place)
    owned = sum(len(s) for s in state["optim"].optim.state.values())
    got = _consolidated(state)
    next_loss = _zero_train(state, step + 1)
    after = _consolidated(state)
    result = {"step": step, "next_loss": next_loss, "owned_state_entries": owned, "world": world()[1]}
    if got is not None:
        ref = torch.load(Path(out) / "zero_ref.pt", weights_only=False)
        result["mismatches"] = _differences(ref["at_save"], got)
        # one more step: bitwise at the saving world size; at another, DDP's all-reduce sums
        # the gradients in another order, so the parameters agree to rounding
        result["next_bitwise"] = _differences(ref["after_next"], after)
        result["next_max_diff"] = max(
            float((v.float() - after["params"][k].float()).abs().max()) for k, v in ref["after_next"]["params"].items()
        )
    return result


def zero_refusals(root: str, out: str) -> dict:
    """The ZeRO set-ups ckptd does not save: each a CheckpointError, nothing committed."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptd.errors import CheckpointError

    rank, ws = world()
    errors = {}
    model = DDP(nn.Linear(4, 3))
    overlap = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    groups = [dist.new_group([r]) for r in range(ws)]  # every rank makes every group
    sub = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, process_group=groups[rank])
    with Checkpointer(root) as ck:
        for name, optim in (("overlap", overlap), ("subgroup", sub)):
            try:
                ck.save(1, {"model": model, "optim": optim}).result()
                errors[name] = None
            except CheckpointError as e:
                errors[name] = str(e)
        errors["latest"] = ck.latest_step()
    return errors
