"""Restore at any world size: each rank plans and reads only the slices it owns.

Steps, on every rank (collective):

1. rank 0 picks the step (latest committed if none asked) and broadcasts it;
2. each rank reads the manifest (O(tensors)) -- no rank gathers anyone's plan;
3. the live state is flattened the same way a save flattens it; keys, global shapes and dtypes
   are checked against the manifest before a byte of data is read;
4. each rank reads the boxes its DTensors own (the whole tensor for a plain tensor) into fresh
   buffers, checking every chunk's crc32c;
5. all ranks agree that every read succeeded, and only then is anything written into ``state``
   (``set_model_state_dict``/``set_optimizer_state_dict``/``load_state_dict``) -- so a failed
   restore leaves ``state`` untouched everywhere;
6. RNG: the rank's own state at the same world size, else reseeded from the saved one.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd import catalog, jsonenc
from ckptd import manifest as mf
from ckptd.errors import CheckpointError, StateMismatchError
from ckptd.reader import CheckpointReader, ReadRequest
from storage_backends import NotFoundError, StorageError, Store
from trainer_hooks import rng
from trainer_hooks.coord import Coordinator
from trainer_hooks.flatten import apply, as_numpy, flatten, zarr_dtype
from trainer_hooks.sharding import is_dtensor, local_tensor, sharding_of

log = logging.getLogger("ckptd.restore")


def _pick_step(store: Store, coord: Coordinator, step: int | None) -> int | None:
    choice: Any = None
    if coord.rank == 0:
        try:
            choice = catalog.latest_step(store) if step is None else catalog.resolve_step(store, step)
        except (CheckpointError, StorageError) as e:
            choice = ("error", str(e))
    choice = coord.broadcast(choice)
    if isinstance(choice, tuple | list):
        raise CheckpointError(choice[1])
    return choice


# What a live value of each kind can be restored from: a module from a plain dict of tensors
# (``ckptd import`` of a torch.save/safetensors file), and so on.
_COMPATIBLE = {
    "module": {"module", "dict"},
    "optimizer": {"optimizer", "dict"},
    "dict": {"dict", "module", "optimizer"},
    "stateful": {"stateful", "dict", "value"},
    "tensor": {"tensor"},
    "value": {"value", "dict", "stateful"},
}


def validate(m: mf.Manifest, flat, where: str, strict: bool) -> list[str]:
    """Check the live state against the manifest; return the keys to read. Raises
    StateMismatchError naming the checkpoint, the key and what differs."""
    live, saved = set(flat.tensors), set(m.tensors)
    if strict:
        missing = sorted(live - saved)
        if missing:
            raise StateMismatchError(
                f"{where}: key {missing[0]!r} is in the state but not in the checkpoint"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + "; pass strict=False to keep those values as they are"
            )
        extra = sorted(saved - live)
        extra_names = sorted(set(m.state) - set(flat.tree))
        if extra_names:
            raise StateMismatchError(f"{where}: key {extra_names[0]!r} is in the checkpoint but not in the state")
        if extra:
            raise StateMismatchError(
                f"{where}: key {extra[0]!r} is in the checkpoint but not in the state"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + "; pass strict=False to ignore it"
            )
        missing_names = sorted(set(flat.tree) - set(m.state))
        if missing_names:
            raise StateMismatchError(f"{where}: key {missing_names[0]!r} is in the state but not in the checkpoint")
    for name, node in flat.tree.items():
        saved_node = m.state.get(name)
        if saved_node is not None and saved_node["kind"] not in _COMPATIBLE[node["kind"]]:
            raise StateMismatchError(
                f"{where}: key {name!r} was saved as a {saved_node['kind']} but the state has a {node['kind']}"
            )
    keys = [k for k in flat.tensors if k in m.tensors]
    for k in keys:
        t, e = flat.tensors[k], m.tensors[k]
        if tuple(t.shape) != e.layout.shape:
            raise StateMismatchError(
                f"{where}: key {k!r} has shape {tuple(e.layout.shape)} in the checkpoint but "
                f"{tuple(t.shape)} in the state"
            )
        dt = zarr_dtype(t.dtype, k)
        if dt != e.layout.dtype:
            raise StateMismatchError(
                f"{where}: key {k!r} has dtype {e.layout.dtype} in the checkpoint but {dt} in the state"
            )
    return keys


def restore_state(
    store: Store,
    coord: Coordinator,
    state: dict[str, Any],
    step: int | None,
    strict: bool,
    pool: ThreadPoolExecutor,
    restore_rng: bool = True,
) -> int | None:
    step = _pick_step(store, coord, step)
    if step is None:
        return None
    where = catalog.where(store, step)
    err: str | None = None
    loaded: dict[str, torch.Tensor] = {}
    m = None
    try:
        m = catalog.load_manifest(store, step)
        flat = flatten(state)
        keys = validate(m, flat, where, strict)
        reader = CheckpointReader(store, mf.step_dir(step))
        requests, outs = [], {}
        for k in keys:
            t = flat.tensors[k]
            sh = sharding_of(t)
            out = torch.empty(sh.local_box.shape, dtype=t.dtype)
            outs[k] = out
            requests.append(ReadRequest(m.tensors[k], sh.local_box, as_numpy(out)))
        reader.read(requests, pool)
        for k in keys:
            t = flat.tensors[k]
            data = outs[k].to(local_tensor(t).device)
            if is_dtensor(t):
                from torch.distributed.tensor import DTensor

                data = DTensor.from_local(
                    data, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )
            loaded[k] = data
    except (CheckpointError, StorageError) as e:
        err = str(e)
    msg = coord.agree(err)
    if msg is not None:
        raise (StateMismatchError if "in the state" in msg or "in the checkpoint" in msg else CheckpointError)(msg)
    apply(state, m.state, loaded, strict)
    if restore_rng:
        _restore_rng(store, m, coord)
    log.info("restored %s at world size %d (saved at %d)", where, coord.world_size, m.world_size)
    return step


def _restore_rng(store: Store, m: mf.Manifest, coord: Coordinator) -> None:
    src = coord.rank if coord.rank < m.world_size else 0
    try:
        rec = json.loads(store.get(mf.done_key(m.step, m.attempt, src)))
    except (NotFoundError, StorageError, ValueError) as e:
        log.warning("no RNG state restored: %s", e)
        return
    if "rng" not in rec:
        return
    saved = jsonenc.decode(rec["rng"])
    if coord.world_size == m.world_size or coord.rank < m.world_size:
        rng.restore(saved)
    else:
        rng.reseed(saved, coord.rank)
