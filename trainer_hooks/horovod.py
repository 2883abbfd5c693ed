"""Horovod: ckptd inside a ``horovodrun`` job (PyTorch, gloo or MPI controller).

Horovod does not create a ``torch.distributed`` process group, which ``Checkpointer``,
``CheckpointHook`` and ``ElasticSampler`` take the rank and the world size from; without one every
Horovod process is a 1-rank ckptd job of its own and the second writer of the root is refused.
``init_process_group()`` forms torch's default group (gloo) with exactly Horovod's ranks, and
``resume`` replaces ``hvd.broadcast_parameters``/``broadcast_optimizer_state``. Usage, why the
state must hold the optimizer ``hvd.DistributedOptimizer`` returned, and why no broadcast follows
a restore: docs/interop.md, "Horovod".

How the group is formed: rank 0 opens a ``TCPStore`` on a free port and sends its address to the
other ranks with ``hvd.broadcast_object``, so no port has to be agreed beforehand and the group
has Horovod's ranks by construction. The address is ``MASTER_ADDR`` when set, else Horovod's name
for rank 0's host (``HOROVOD_HOSTNAME``: the name given to ``horovodrun -H``, which the launcher
reached), else this host's name. gloo's interface is Horovod's (``HOROVOD_GLOO_IFACE``) unless
``GLOO_SOCKET_IFNAME`` is set.

Resizing: Horovod's own elastic mode (``hvd.elastic.run``, ``horovodrun --min-np``) restores its
in-memory ``State`` after a host change; ckptd is for the restart of the whole job at another
``-np`` (a preemption, a new allocation): the state saved at N ranks restores at M.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptd.errors import CheckpointError

try:
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - not installable from PyPI against torch >= 2.1
    raise ImportError(
        "trainer_hooks.horovod needs horovod.torch: deploy/build_horovod.sh builds horovod 0.28.1 for this torch"
    ) from None

__all__ = ["init_process_group", "is_distributed_optimizer", "resume"]


def init_process_group(timeout: timedelta = timedelta(minutes=10)) -> None:
    """Form torch.distributed's default process group (gloo) from Horovod's ranks; collective.

    Call after ``hvd.init()`` on every rank. Returns at once if a default group already exists
    with Horovod's rank and size (a job that formed one itself); one of another shape is refused.
    """
    if not hvd.is_initialized():
        raise CheckpointError("call hvd.init() before trainer_hooks.horovod.init_process_group()")
    rank, size = hvd.rank(), hvd.size()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise CheckpointError(
                f"a torch.distributed group exists as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but Horovod has this process as rank {rank} of {size}: ckptd needs the two to agree"
            )
        return
    if "HOROVOD_GLOO_IFACE" in os.environ:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOROVOD_GLOO_IFACE"])
    store = where = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or os.environ.get("HOROVOD_HOSTNAME") or socket.getfqdn()
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        where = (host, store.port)
    host, port = hvd.broadcast_object(where, root_rank=0, name="ckptd.init_process_group")
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def resume(checkpointer, state: dict[str, Any], **restore_kwargs: Any) -> int:
    """Restore the latest committed step into ``state`` (at this job's size); the step to train
    next. With nothing to restore, rank 0's parameters and optimizer state go to every rank
    (Horovod's ``broadcast_parameters``/``broadcast_optimizer_state``) and 0 is returned."""
    _check_optimizers(state)
    for value in state.values():
        if is_distributed_optimizer(value):
            _init_state(value)
    step = checkpointer.restore(state, **restore_kwargs)
    if step is not None:
        return step + 1
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            hvd.broadcast_parameters(value.state_dict(), root_rank=0)
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            hvd.broadcast_optimizer_state(value, root_rank=0)
    return 0


def is_distributed_optimizer(optim: Any) -> bool:
    """Whether ``optim`` came from ``hvd.DistributedOptimizer``. Horovod builds a new class per
    call, ``type(name, (type(opt),), dict(_DistributedOptimizer.__dict__))``: a copy of its
    methods, not a subclass, so ``isinstance`` cannot tell; its all-reduce method can."""
    return isinstance(optim, torch.optim.Optimizer) and "_allreduce_grad_async" in type(optim).__dict__


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh Horovod optimizer its state (zero moments) the way torch's state-dict API
    does for any optimizer -- zero gradients, one step at lr 0 -- but through the wrapped class.

    torch.distributed.checkpoint's ``_init_optim_state``, which ckptd's restore relies on, ends
    with ``optim.zero_grad(set_to_none=True)``, and Horovod 0.28's ``zero_grad(self)`` takes no
    argument: the restore failed with a TypeError. The wrapped class's ``step`` also skips
    Horovod's all-reduce of the (zero) gradients, a collective with nothing to reduce."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise CheckpointError("restore the optimizer before the first backward (its gradients are set)")
    inner = type(optim).__mro__[1]  # Horovod's class is type(name, (type(opt),), ...)
    lrs = [g.get("lr") for g in optim.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        inner.step(optim)
    finally:
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p in params:
            p.grad = None


def _check_optimizers(state: dict[str, Any]) -> None:
    """Refuse an unwrapped optimizer beside Horovod's wrapper over the same parameters."""
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    wrapped = {k: v for k, v in optims.items() if is_distributed_optimizer(v)}
    wrapped_params = {id(p) for o in wrapped.values() for g in o.param_groups for p in g["params"]}
    for name, o in optims.items():
        if name not in wrapped and any(id(p) in wrapped_params for g in o.param_groups for p in g["params"]):
            raise CheckpointError(
                f"state[{name!r}] is the optimizer given to hvd.DistributedOptimizer, which does not use it "
                "again: put the optimizer hvd.DistributedOptimizer returned in the state instead"
            )
