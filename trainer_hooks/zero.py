"""``torch.distributed.optim.ZeroRedundancyOptimizer``: its state saved as it is held, one
partition per rank, and restored at any world size.

A ZeRO optimizer wraps a local optimizer (``zero.optim``) over this rank's partition of the
parameters; the partition is a function of the world size (a greedy split by size). Its own
``state_dict`` needs ``consolidate_state_dict`` first (all the state gathered on one rank);
``get_optimizer_state_dict`` calls it and fails with torch's "Optimizer state has not been
consolidated on this rank". Here instead:

* save: each rank contributes the state of the parameters it owns, keyed by their FQNs exactly
  as ``get_optimizer_state_dict`` keys a plain optimizer's (so a ZeRO checkpoint and a plain
  one of the same optimizer class are interchangeable), and every rank learns the shapes,
  dtypes and other values of the whole state in one ``all_gather_object`` of that skeleton
  (no tensor data moves). A tensor of the state is then *owned*: its one holder writes it
  whole, the other ranks carry a ``meta`` tensor of its shape and dtype (``Flat.owned``,
  ``sharding.owned_sharding``). The parameter groups are the global ones, by FQN.
* restore: the live optimizer is flattened the same way under the new world size's partition;
  each rank reads only the tensors of the parameters it now owns, by FQN, from the global
  arrays, and puts them into its local optimizer (``load``). Nothing is consolidated, and no
  rank holds more than its partition.

A 0-d state tensor (Adam's ``step``) travels by value in that skeleton (``_describe``) and is
saved replicated, into the manifest, as any optimizer's step count.
Refused with a ``CheckpointError`` saying what to do: ``overlap_with_ddp=True`` (whose local
optimizer exists only after DDP's buckets are built), a ZeRO over a subgroup of the job (every
replica group would write its own copy of each partition) and DTensor parameters (FSDP2's
optimizer state is sharded already).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from ckptd.errors import CheckpointError, StateMismatchError

__all__ = ["is_zero", "load", "local_optimizer", "state_dict"]


def is_zero(optim: Any) -> bool:
    # Not imported here: ``torch.distributed.optim`` takes 0.2 s to import. A
    # ZeroRedundancyOptimizer exists only once its module has been imported.
    cls = getattr(sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer"), "ZeroRedundancyOptimizer", None)
    return cls is not None and isinstance(optim, cls)


def local_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds ``optim``'s state on this rank (ZeRO's local one, else itself)."""
    return optim.optim if is_zero(optim) else optim


def _fqns(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    """Parameter -> FQN as ``get_optimizer_state_dict`` names it (no DDP ``module.`` prefix, no
    ``torch.compile`` prefix)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[torch.Tensor, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:  # pragma: no cover - FSDP1 flat parameters; ZeRO runs under DDP
            raise CheckpointError(
                f"parameter {name!r} has FQNs {sorted(fqns)}: unsupported under ZeroRedundancyOptimizer"
            )
        out.setdefault(p, next(iter(fqns)))
    return out


def _check(optim, model) -> dict[torch.Tensor, str]:
    if getattr(optim, "_overlap_with_ddp", False):
        raise CheckpointError(
            "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported: construct it with "
            "overlap_with_ddp=False (the default) to checkpoint it"
        )
    if dist.get_world_size(optim.process_group) != dist.get_world_size():
        # Each replica group would hold (and write) its own copy of every partition.
        raise CheckpointError(
            "a ZeroRedundancyOptimizer over a subgroup of the job is not supported: give it the "
            "whole job's process group (the default), or save only one replica group's state"
        )
    if any(type(p).__name__ == "DTensor" for g in optim.param_groups for p in g["params"]):
        raise CheckpointError(
            "a ZeroRedundancyOptimizer over DTensor parameters is not supported; use FSDP2 (fully_shard), "
            "whose optimizer state ckptd shards by itself"
        )
    fqn = _fqns(model)
    missing = [p for g in optim.param_groups for p in g["params"] if p not in fqn]
    if missing:
        raise CheckpointError(
            f"ZeroRedundancyOptimizer trains {len(missing)} parameters that are not in the model it is saved with"
        )
    return fqn


def state_dict(optim, model: torch.nn.Module) -> tuple[dict, dict[tuple[str, str], int], int]:
    """``(data, owners, rank)``: ``data`` is the optimizer's state dict in the form of
    ``get_optimizer_state_dict`` (``{"state": {fqn: {name: value}}, "param_groups": [...]}``)
    over every parameter with state on any rank; a tensor that another rank owns is a ``meta``
    tensor of its shape and dtype. ``owners[(fqn, name)]`` is the global rank that holds each
    state tensor. Collective over the optimizer's process group (one ``all_gather_object``)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    fqn = _check(optim, model)
    local = optim.optim
    _init_optim_state(local)  # what get_optimizer_state_dict does for a fresh optimizer
    group = optim.process_group
    me = dist.get_rank()
    held: dict[str, dict[str, Any]] = {}
    skeleton: dict[str, list] = {}
    for g in local.param_groups:
        for p in g["params"]:
            s = local.state.get(p)
            if not s:
                continue
            held[fqn[p]] = s
            skeleton[fqn[p]] = [(k, _describe(v)) for k, v in s.items()]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (me, skeleton), group=group)
    merged: dict[str, tuple[int, list]] = {}
    for rank, sk in gathered:
        for f, entries in sk.items():
            merged.setdefault(f, (rank, entries))
    state: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], int] = {}
    for g in optim.param_groups:  # global order: the same on every rank
        for p in g["params"]:
            f = fqn[p]
            if f not in merged or f in state:
                continue
            rank, entries = merged[f]
            out: dict[str, Any] = {}
            for k, (kind, *info) in entries:
                if kind == "tensor":
                    owners[(f, k)] = rank
                if kind == "value":
                    out[k] = info[0]
                elif rank == me:
                    out[k] = held[f][k]
                elif kind == "scalar":  # every rank has its value: a replicated 0-d tensor
                    value, device = info
                    out[k] = value.to(device)
                else:
                    shape, dtype = info
                    out[k] = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            state[f] = out
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[p] for p in g["params"]]}
        for g in optim.param_groups
    ]
    return {"state": state, "param_groups": groups}, owners, me


def _describe(v: Any) -> tuple:
    """What every rank learns of one state value: a 0-d tensor's value (a box cannot say that
    one rank holds a 0-d tensor and another not, so it is replicated, by value), a tensor's
    shape and dtype, any other value itself."""
    if not torch.is_tensor(v):
        return ("value", v)
    if v.dim() == 0:
        return ("scalar", v.detach().cpu().clone(), v.device.type)
    return ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."))


def load(optim, model: torch.nn.Module, data: dict, undo: list) -> None:
    """Put the restored ``data`` (``state_dict``'s form; tensors only for the parameters this
    rank owns under the current partition) into ``optim``: its local optimizer gets the state of
    its parameters (none for one the checkpoint kept none for), both its global and its local
    groups the saved hyperparameters. Appends to ``undo`` what puts it all back."""
    fqn = _check(optim, model)
    saved_groups = data.get("param_groups", [])
    if len(saved_groups) != len(optim.param_groups):
        raise StateMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, the ZeroRedundancyOptimizer "
            f"{len(optim.param_groups)}"
        )
    for i, (sg, g) in enumerate(zip(saved_groups, optim.param_groups, strict=True)):
        if sorted(sg.get("params", [])) != sorted(fqn[p] for p in g["params"]):
            raise StateMismatchError(
                f"parameter group {i} holds other parameters in the checkpoint than in the optimizer"
            )
    local = optim.optim
    saved = data.get("state", {})
    new_state: dict[torch.Tensor, dict] = {}
    for g in local.param_groups:
        for p in g["params"]:
            s = saved.get(fqn[p])
            if s:
                new_state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v for k, v in s.items()}
    old_state = dict(local.state)
    old_groups = [[(g, dict(g)) for g in gs] for gs in (optim.param_groups, local.param_groups)]

    def back():
        local.state.clear()
        local.state.update(old_state)
        for gs in old_groups:
            for g, items in gs:
                g.clear()
                g.update(items)

    undo.append(back)
    local.state.clear()
    local.state.update(new_state)
    for sg, g, lg in zip(saved_groups, optim.param_groups, local.param_groups, strict=True):
        for k, v in sg.items():
            if k != "params":
                g[k] = lg[k] = v
