"""Turn a user's ``state`` dict into array keys + a JSON tree, and back.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict`` so every wrapper
(DDP, FSDP2, TP, 2-D) yields the same FQN-keyed, DTensor-sharded view; we never reach into FSDP
internals (imported at first use: that package imports DTensor and sympy, most of a second
of ``import trainer_hooks`` otherwise). Any object with ``state_dict``/``load_state_dict`` is
stored through those. Every tensor met becomes a zarr array named by its path (``model/layers.0.weight``,
``optim/state/layers.0.weight/exp_avg``); everything else is typed JSON (``ckptd.jsonenc``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd import jsonenc
from ckptd.dtypes import as_numpy, zarr_dtype
from ckptd.errors import CheckpointError, StateMismatchError
from ckptd.manifest import key_of
from trainer_hooks import zero
from trainer_hooks.sharding import Sharding, local_tensor, owned_sharding, sharding_of

# as_numpy: re-exported for callers that imported it from here (it lives in ckptd.dtypes)
__all__ = ["Flat", "apply", "as_numpy", "flatten"]

MODULE, OPTIMIZER, STATEFUL, TENSOR, DICT, VALUE = (
    "module",
    "optimizer",
    "stateful",
    "tensor",
    "dict",
    "value",
)


@dataclass
class Flat:
    """``tensors``: array key -> tensor (DTensor or plain), in state order; ``tree``: per
    top-level name, ``{"kind": ..., "data": <jsonenc tree with $tensor refs>}``.

    ``synced``: the keys whose replicas are identical on every rank that holds them: a module's
    parameters (DDP all-reduces their gradients, FSDP/TP shard them) and the optimizer state
    computed from those gradients. Every other tensor (buffers such as BatchNorm's running
    statistics, which each DDP rank updates with its own batch; user tensors) may differ between
    replicas, so a save writes it from the lowest rank that holds it -- the rank DDP broadcasts
    buffers from at the next forward.

    ``owned``: keys held whole by one rank only (the value: its global rank), the state of a
    ``ZeroRedundancyOptimizer`` (``trainer_hooks.zero``); on the other ranks ``tensors`` has a
    ``meta`` tensor of its shape and dtype. ``sharding(key)`` is where each key's data is."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tree: dict[str, dict] = field(default_factory=dict)
    synced: set[str] = field(default_factory=set)
    owned: dict[str, int] = field(default_factory=dict)

    def sharding(self, key: str) -> Sharding:
        owner = self.owned.get(key)
        t = self.tensors[key]
        return sharding_of(t) if owner is None else owned_sharding(tuple(t.shape), owner)

    def holds(self, key: str) -> bool:
        """Whether this rank has the data of ``key`` (all but the other ranks' owned keys)."""
        return key not in self.owned or self.tensors[key].device.type != "meta"


def _trained_model(optim: torch.optim.Optimizer, state: dict) -> torch.nn.Module | None:
    """The first module of ``state`` that has a parameter ``optim`` trains, or None."""
    ids = {id(p) for g in optim.param_groups for p in g["params"]}
    for v in state.values():
        if isinstance(v, torch.nn.Module) and any(id(p) in ids for p in v.parameters()):
            return v
    return None


def _model_of(optim: torch.optim.Optimizer, state: dict, name: str) -> torch.nn.Module:
    model = _trained_model(optim, state)
    if model is not None:
        return model
    raise CheckpointError(
        f"key {name!r}: optimizer's parameters belong to no torch.nn.Module in the state; "
        "put the model in the same state dict"
    )


def _paired_state_dicts(state: dict[str, Any]) -> dict[int, dict]:
    """For a model that exactly one optimizer of the state trains: both state dicts from one
    ``get_state_dict`` call (id of the model / optimizer -> its state dict). The helper's set-up
    (FQN maps over every parameter) then runs once instead of twice per save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    owner: dict[int, list] = {}
    for o in state.values():  # a ZeRO optimizer is flattened by ``trainer_hooks.zero``, never here
        if isinstance(o, torch.optim.Optimizer) and not zero.is_zero(o) and (m := _trained_model(o, state)) is not None:
            owner.setdefault(id(m), [m]).append(o)
    out: dict[int, dict] = {}
    for m, *opts in owner.values():
        if len(opts) == 1:
            out[id(m)], out[id(opts[0])] = get_state_dict(m, opts[0])
    return out


def flatten(state: dict[str, Any]) -> Flat:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    flat = Flat()
    params: set[int] = set()  # storages of the parameters of the module being encoded
    optimizer = False  # encoding an optimizer: its state tensors are synced

    def on_tensor(path: tuple[str, ...], t: torch.Tensor) -> str:
        key = key_of(path)
        if key in flat.tensors:
            raise CheckpointError(f"key {key!r} appears twice in the state")
        zarr_dtype(t.dtype, key)
        flat.tensors[key] = t
        if (optimizer and path[1] == "state") or _storage(t) in params:
            flat.synced.add(key)
        if optimizer and path[1] == "state" and (path[2], path[3]) in owned:
            flat.owned[key] = owned[(path[2], path[3])]
        return key

    paired = _paired_state_dicts(state)
    owned: dict[tuple[str, str], int] = {}  # (fqn, state name) -> owner, of the optimizer being encoded
    for name, v in state.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"top-level state keys must be non-empty strings, got {name!r}")
        if isinstance(v, torch.nn.Module):
            kind, data = MODULE, paired[id(v)] if id(v) in paired else get_model_state_dict(v)
        elif isinstance(v, torch.optim.Optimizer) and zero.is_zero(v):
            kind = OPTIMIZER
            data, owned, _ = zero.state_dict(v, _model_of(v, state, name))
        elif isinstance(v, torch.optim.Optimizer):
            kind = OPTIMIZER
            data = paired[id(v)] if id(v) in paired else get_optimizer_state_dict(_model_of(v, state, name), v)
        elif isinstance(v, torch.Tensor):
            kind, data = TENSOR, v
        elif callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            kind, data = STATEFUL, v.state_dict()
        elif isinstance(v, dict):
            kind, data = DICT, v
        else:
            kind, data = VALUE, v
        if kind in (MODULE, OPTIMIZER):  # FQNs are one path component each
            # A state dict's parameter entries share their parameter's storage (a DDP state dict
            # holds ``param.detach()``, FSDP2's the sharded DTensor itself), buffers never do.
            params = {_storage(p) for p in v.parameters()} - {0} if kind == MODULE else set()
            optimizer = kind == OPTIMIZER
            enc = _encode_fqn_tree(kind, data, name, on_tensor)
            params, optimizer, owned = set(), False, {}
        else:
            enc = jsonenc.encode(data, on_tensor, (name,))
        flat.tree[name] = {"kind": kind, "data": enc}
    return flat


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


def _encode_fqn_tree(kind, data, name, on_tensor):
    if kind == MODULE:
        return {fqn: jsonenc.encode(t, on_tensor, (name, fqn)) for fqn, t in data.items()}
    return {
        "state": {
            fqn: {k: jsonenc.encode(v, on_tensor, (name, "state", fqn, k)) for k, v in s.items()}
            for fqn, s in data.get("state", {}).items()
        },
        "param_groups": jsonenc.encode(data.get("param_groups", []), on_tensor, (name, "param_groups")),
    }


def apply(
    state: dict[str, Any],
    saved_tree: dict[str, dict],
    loaded: dict[str, torch.Tensor],
    strict: bool,
    undo: list,
    where: str = "checkpoint",
) -> None:
    """Load decoded values into ``state``. ``loaded[key]`` is the restored tensor for each array
    key (already sharded like the live one). Keys absent from ``loaded`` were skipped
    (non-strict, or an optimizer's parameter that had no state at save); entries that refer to
    them are dropped. Entries of the checkpoint that ``state`` lacks are not applied.

    Before it changes an entry, appends to ``undo`` a callable that puts the entry's non-tensor
    state back (an optimizer's state and groups, a stateful object's ``state_dict``, a dict's
    values); tensor contents are the caller's to put back. Any error is a ``StateMismatchError``
    naming the entry; the caller then runs ``undo`` in reverse."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(strict=strict)
    for name, v in state.items():
        entry = saved_tree.get(name)
        if entry is None:
            continue  # validated by the caller: only reachable when not strict
        try:
            data = _drop_missing(jsonenc.decode(entry["data"], lambda key: loaded.get(key, _MISSING)))
            if isinstance(v, torch.nn.Module):
                set_model_state_dict(v, data, options=opts)
            elif isinstance(v, torch.optim.Optimizer) and zero.is_zero(v):
                zero.load(v, _model_of(v, state, name), data, undo)
            elif isinstance(v, torch.optim.Optimizer):
                undo.append(_optimizer_undo(v))
                # Not strict here: the caller has matched the keys already, and a parameter
                # that had no state at save (an unused pooler, an unrouted expert) must get
                # none now, which torch's strict mode refuses.
                set_optimizer_state_dict(_model_of(v, state, name), v, data, options=StateDictOptions(strict=False))
            elif isinstance(v, torch.Tensor):
                if isinstance(data, torch.Tensor):
                    _copy_into(v, data)
            elif not isinstance(v, dict) and callable(getattr(v, "load_state_dict", None)):
                old = copy.deepcopy(v.state_dict())
                undo.append(lambda v=v, old=old: v.load_state_dict(old))
                v.load_state_dict(data)  # dispatch on the live object: an import may have saved a dict
            elif isinstance(v, dict) and isinstance(data, dict):
                undo.append(_dict_undo(v))
                _merge_into(v, data)
            else:
                undo.append(lambda name=name, old=v: state.__setitem__(name, old))
                state[name] = data
        except CheckpointError:
            raise
        except Exception as e:  # the state does not take what the checkpoint holds
            raise StateMismatchError(
                f"{where}: key {name!r}: applying the saved state failed: {type(e).__name__}: {e}"
            ) from e


def _optimizer_undo(optim: torch.optim.Optimizer):
    # ``load_state_dict`` replaces both the state and the group dicts (it never mutates the old
    # ones), so keeping references is a complete backup; tensors inside are the caller's.
    state, groups = optim.state, optim.param_groups
    return lambda: optim.__setstate__({"state": state, "param_groups": groups})


def _dict_undo(target: dict):
    """A callable that puts ``target`` (and the dicts nested in it) back to their current items."""
    items = [(k, v, _dict_undo(v) if isinstance(v, dict) else None) for k, v in target.items()]

    def run():
        target.clear()
        for k, v, nested in items:
            if nested is not None:
                nested()
            target[k] = v

    return run


_MISSING = object()  # stands for a saved tensor that the live state does not have (non-strict)


def _drop_missing(x):
    if isinstance(x, dict):
        return {k: _drop_missing(v) for k, v in x.items() if v is not _MISSING}
    if isinstance(x, list):
        return [_drop_missing(v) for v in x]
    return None if x is _MISSING else x


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        local_tensor(dst).copy_(local_tensor(src))


def _merge_into(target: dict, data: dict) -> None:
    """Update a user dict in place: tensors are copied into the existing tensors (so references
    the user holds stay valid), nested dicts merged, other values replaced."""
    for k, v in data.items():
        cur = target.get(k)
        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
            _copy_into(cur, v)
        elif isinstance(cur, dict) and isinstance(v, dict):
            _merge_into(cur, v)
        else:
            target[k] = v
