"""DeepSpeed universal checkpoints (ZeRO stage 1/2, as ``ds_to_universal.py`` writes them), read
from their documented layout; DeepSpeed itself is not needed::

    <SRC>/zero/<param name>/fp32.pt         {"param": fp32 tensor, "cat_dim": ..., ...}
                           /exp_avg.pt      the same, for each optimizer state
                           /exp_avg_sq.pt
                           /step.pt         the step (a number or 0-d tensor)
    <SRC>/zero/optimizer_state.pt           param_groups (hyperparameters) and DeepSpeed state

SRC is the universal folder (holding ``zero/``) or ``zero/`` itself. Every ``.pt`` file is read
with ``torch.load(weights_only=True)``; nothing is unpickled beyond tensors and plain values.

What comes in: the fp32 master weights under ``--as`` (default ``model``, kind ``dict``: restore
into a module whose parameters are fp32), and, when the hyperparameters can be read,
``optim`` in the shape ``get_optimizer_state_dict`` gives (``state`` per parameter name, ``step``
as a 0-d float32 tensor as torch's Adam keeps it; one param group holding every parameter, with
the hyperparameters of DeepSpeed's single group). Parameter names are DeepSpeed's, the FQNs of
the module given to ``deepspeed.initialize``.

Not covered, with a clear error or note: ZeRO-3 universal files (flat tensors whose shapes live
only in DeepSpeed's pickled model states), parameters with DeepSpeed sub-parameter layouts
(fused QKV metadata objects), several param groups (DeepSpeed numbers parameters, it does not
name them) and an ``optimizer_state.pt`` that holds objects other than DeepSpeed's own
bookkeeping: the optimizer is then left out and only the weights are imported.

DeepSpeed pickles its loss scaler and ZeRO stage enum into ``optimizer_state.pt``, even in fp32
training (DeepSpeed 0.19). Those classes (``DEEPSPEED_BOOKKEEPING``) unpickle as inert
``Opaque`` records, never as DeepSpeed objects: nothing of DeepSpeed is imported or run, and
ckptd reads only ``param_groups`` from the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from ckptd.errors import CheckpointError
from ckptd.interop.common import ImportTree, Item, release_file_pages
from ckptd.interop.torchfile import safe_load

__all__ = ["DEEPSPEED_BOOKKEEPING", "FP32", "OPTIMIZER_STATE", "PARAM", "STEP", "read"]

FP32 = "fp32.pt"
STEP = "step.pt"
OPTIMIZER_STATE = "optimizer_state.pt"
PARAM = "param"
DEEPSPEED_BOOKKEEPING = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def _load(path: str, mmap: bool = True) -> Any:
    return safe_load(path, mmap)[0]


def _param(obj: Any, path: str) -> torch.Tensor:
    if isinstance(obj, dict) and isinstance(obj.get(PARAM), torch.Tensor):
        return obj[PARAM]
    if isinstance(obj, torch.Tensor):
        raise CheckpointError(
            f"{path}: holds a bare tensor (a ZeRO-3 universal checkpoint, whose shapes only DeepSpeed's "
            "pickled model states record); convert it with DeepSpeed's zero_to_fp32 or load it in DeepSpeed"
        )
    raise CheckpointError(f"{path}: expected a dict with a {PARAM!r} tensor")


def read(src: str, as_key: str = "model") -> tuple[ImportTree, Any]:
    zero = os.path.join(src, "zero") if os.path.isdir(os.path.join(src, "zero")) else src
    if not os.path.isdir(zero):
        raise CheckpointError(f"{src}: no such folder")
    names = sorted(d for d in os.listdir(zero) if os.path.isfile(os.path.join(zero, d, FP32)))
    if not names:
        raise CheckpointError(f"{src}: not a DeepSpeed universal checkpoint (no zero/<param>/{FP32})")
    tree = ImportTree(info={"format": "deepspeed-universal", "path": os.path.abspath(src)})
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for name in names:
        folder = os.path.join(zero, name)
        for fname in sorted(f for f in os.listdir(folder) if f.endswith(".pt")):
            path = os.path.join(folder, fname)
            obj = _load(path)
            if fname == STEP:
                step = obj.item() if isinstance(obj, torch.Tensor) else obj
                if not isinstance(step, int | float):
                    raise CheckpointError(f"{path}: step is a {type(step).__name__}, not a number")
                state.setdefault(name, {})["step"] = torch.tensor(float(step), dtype=torch.float32)
                continue
            t = _param(obj, path)
            stand_in = tree.placeholder(path, t.shape, t.dtype)
            if fname == FP32:
                model[name] = stand_in
            else:
                state.setdefault(name, {})[fname[: -len(".pt")]] = stand_in
            del obj, t
            release_file_pages(path)
    tree.add(as_key, "dict", model)
    groups, why = _param_groups(zero, names)
    if groups is None:
        tree.info["notes"] = [f"optimizer state left out: {why}"]
    elif as_key == "optim":
        raise CheckpointError(f"{src}: --as optim would collide with the optimizer entry; choose another name")
    else:
        tree.add("optim", "optimizer", {"state": {n: state[n] for n in names if n in state}, "param_groups": groups})

    def load(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        for it in items:
            if isinstance(it.source, torch.Tensor):  # the step, made here
                yield it, it.source
                continue
            yield it, _param(_load(it.source), it.source)
            release_file_pages(it.source)

    return tree, load


def _param_groups(zero: str, names: list[str]) -> tuple[list[dict] | None, str]:
    path = os.path.join(zero, OPTIMIZER_STATE)
    if not os.path.isfile(path):
        return None, f"{path} is missing (it holds the hyperparameters)"
    try:
        obj = safe_load(path, False, stand_ins=DEEPSPEED_BOOKKEEPING)[0]
    except CheckpointError as e:
        return None, str(e)
    groups = obj.get("param_groups") if isinstance(obj, dict) else None
    if not isinstance(groups, list) or not groups:
        return None, f"{path} has no param_groups"
    if len(groups) > 1:
        return None, f"{path} has {len(groups)} param groups, and DeepSpeed numbers their parameters without names"
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    return [{**hyper, "params": list(names)}], ""
