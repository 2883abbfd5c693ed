"""DeepSpeed universal checkpoints (ZeRO stage 1/2/3, as ``ds_to_universal.py`` writes them), read
from their documented layout; DeepSpeed itself is not needed::

    <SRC>/zero/<param name>/fp32.pt         {"param": fp32 tensor, "cat_dim": ..., ...}
                           /exp_avg.pt      the same, for each optimizer state
                           /exp_avg_sq.pt
                           /step.pt         the step (a number or 0-d tensor)
    <SRC>/zero/optimizer_state.pt           param_groups (hyperparameters) and DeepSpeed state

SRC is the universal folder (holding ``zero/``) or ``zero/`` itself. Every ``.pt`` file is read
with ``torch.load(weights_only=True)``. DeepSpeed pickles its loss scaler and ZeRO stage enum
into ``optimizer_state.pt`` even in fp32 training: those classes (``DEEPSPEED_BOOKKEEPING``)
unpickle as inert ``Opaque`` records, so nothing of DeepSpeed is imported or run. ZeRO-3 files
hold each tensor flat; the shapes come from ``param_shapes`` in the ``*_model_states.pt`` that
``ds_to_universal`` copies beside ``zero/``.

What comes in (the fp32 weights under ``--as``; ``optim`` in the ``get_optimizer_state_dict``
shape when the hyperparameters can be read) and what is not covered: docs/interop.md, DeepSpeed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from ckptd.errors import CheckpointError
from ckptd.interop.common import ImportTree, Item, release_file_pages
from ckptd.interop.torchfile import safe_load

__all__ = ["DEEPSPEED_BOOKKEEPING", "FP32", "MODEL_STATES", "OPTIMIZER_STATE", "PARAM", "STEP", "read"]

FP32 = "fp32.pt"
STEP = "step.pt"
OPTIMIZER_STATE = "optimizer_state.pt"
MODEL_STATES = "_model_states.pt"  # zero_pp_rank_<r>_mp_rank_<m>_model_states.pt: ZeRO-3 shapes
PARAM = "param"
DEEPSPEED_BOOKKEEPING = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def _param(obj: Any, path: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor of one ``zero/<name>/<state>.pt``: ZeRO-1/2 store ``{"param": tensor}``; ZeRO-3
    stores the bare flat tensor, given its ``shape`` from the model states (``_zero3_shapes``)."""
    if isinstance(obj, dict) and isinstance(obj.get(PARAM), torch.Tensor):
        return obj[PARAM]
    if isinstance(obj, torch.Tensor):
        if shape is None:
            raise CheckpointError(
                f"{path}: holds a bare tensor (a ZeRO-3 universal checkpoint) and no "
                f"*{MODEL_STATES} beside zero/ records its shape; convert it with DeepSpeed's zero_to_fp32"
            )
        if obj.dim() != 1 or obj.numel() != math.prod(shape):
            raise CheckpointError(
                f"{path}: holds {obj.numel()} values in shape {tuple(obj.shape)}, but the model states "
                f"record shape {list(shape)} for it"
            )
        return obj.view(shape)
    raise CheckpointError(f"{path}: expected a dict with a {PARAM!r} tensor")


def _zero3_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a ZeRO-3 universal checkpoint: ``param_shapes`` (and
    ``frozen_param_shapes``) of the first ``*_model_states.pt`` in ``folder`` (every rank's file
    records all of them), read like ``optimizer_state.pt``: tensors, plain values, and DeepSpeed's
    bookkeeping as inert records. Empty when there is no such file or it records none."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(MODEL_STATES)) if os.path.isdir(folder) else []
    if not files:
        return {}
    path = os.path.join(folder, files[0])
    obj = safe_load(path, False, stand_ins=DEEPSPEED_BOOKKEEPING)[0]
    groups = obj.get("param_shapes") if isinstance(obj, dict) else None
    groups = [groups] if isinstance(groups, dict) else list(groups or [])
    frozen = obj.get("frozen_param_shapes") if isinstance(obj, dict) else None
    shapes: dict[str, tuple[int, ...]] = {}
    for group in [*groups, frozen or {}]:
        if not isinstance(group, dict):
            raise CheckpointError(f"{path}: param_shapes is not a list of name -> shape maps")
        for name, shape in group.items():
            dims = tuple(shape) if isinstance(shape, tuple | list | torch.Size) else None
            if not isinstance(name, str) or dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
                raise CheckpointError(f"{path}: param_shapes holds {name!r}: {shape!r}, not a name and a shape")
            shapes[name] = dims
    return shapes


def read(src: str, as_key: str = "model") -> tuple[ImportTree, Any]:
    zero = os.path.join(src, "zero") if os.path.isdir(os.path.join(src, "zero")) else src
    if not os.path.isdir(zero):
        raise CheckpointError(f"{src}: no such folder")
    names = sorted(d for d in os.listdir(zero) if os.path.isfile(os.path.join(zero, d, FP32)))
    if not names:
        raise CheckpointError(f"{src}: not a DeepSpeed universal checkpoint (no zero/<param>/{FP32})")
    # ZeRO-3's shapes, read on the first bare tensor only: a ZeRO-1/2 folder's model states hold
    # the whole module's weights, which an import of the universal files must not read too
    shapes: dict[str, tuple[int, ...]] | None = None

    def shape_of(name: str, obj: Any) -> tuple[int, ...] | None:
        nonlocal shapes
        if not isinstance(obj, torch.Tensor):
            return None
        if shapes is None:
            shapes = _zero3_shapes(src if zero != src else os.path.dirname(os.path.abspath(src)))  # beside zero/
        return shapes.get(name)

    tree = ImportTree(info={"format": "deepspeed-universal", "path": os.path.abspath(src)})
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for name in names:
        folder = os.path.join(zero, name)
        for fname in sorted(f for f in os.listdir(folder) if f.endswith(".pt")):
            path = os.path.join(folder, fname)
            obj = safe_load(path)[0]
            if fname == STEP:
                step = obj.item() if isinstance(obj, torch.Tensor) else obj
                if not isinstance(step, int | float):
                    raise CheckpointError(f"{path}: step is a {type(step).__name__}, not a number")
                state.setdefault(name, {})["step"] = torch.tensor(float(step), dtype=torch.float32)
                continue
            t = _param(obj, path, shape_of(name, obj))
            stand_in = tree.placeholder(path, t.shape, t.dtype)
            if fname == FP32:
                model[name] = stand_in
            else:
                state.setdefault(name, {})[fname[: -len(".pt")]] = stand_in
            del obj, t
            release_file_pages(path)
    tree.add(as_key, "dict", model)
    groups, why, group_step = _param_groups(zero, names)
    if group_step is not None:  # ZeRO-3 writes no step.pt: its one group's step stands for all
        for moments in state.values():
            moments.setdefault("step", torch.tensor(group_step, dtype=torch.float32))
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
            obj = safe_load(it.source)[0]
            yield it, _param(obj, it.source, shape_of(os.path.basename(os.path.dirname(it.source)), obj))
            release_file_pages(it.source)

    return tree, load


def _param_groups(zero: str, names: list[str]) -> tuple[list[dict] | None, str, float | None]:
    """(the one param group for ``names``, or None and why; the step count that
    ``optimizer_state_dict`` keeps for that group, where a ZeRO-3 checkpoint keeps it)."""
    path = os.path.join(zero, OPTIMIZER_STATE)
    if not os.path.isfile(path):
        return None, f"{path} is missing (it holds the hyperparameters)", None
    try:
        obj = safe_load(path, False, stand_ins=DEEPSPEED_BOOKKEEPING)[0]
    except CheckpointError as e:
        return None, str(e), None
    groups = obj.get("param_groups") if isinstance(obj, dict) else None
    if not isinstance(groups, list) or not groups:
        return None, f"{path} has no param_groups", None
    if len(groups) > 1:
        why = f"{path} has {len(groups)} param groups, and DeepSpeed numbers their parameters without names"
        return None, why, None
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    return [{**hyper, "params": list(names)}], "", _group_step(obj)


def _group_step(obj: dict) -> float | None:
    inner = obj.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    group = state.get(0) if isinstance(state, dict) else None
    step = group.get("step") if isinstance(group, dict) else None
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    return float(step) if isinstance(step, int | float) and not isinstance(step, bool) else None
