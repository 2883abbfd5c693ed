"""PyTorch Distributed Checkpoint (DCP) folders: import one, or export a checkpoint as one.

**Importing DCP trusts its metadata**: ``.metadata`` is a pickle that torch's own
``FileSystemReader`` (the only reader there is) unpickles, which can run code stored in it.
Non-tensor values are read with ``torch.load(weights_only=True)``; the ckptd checkpoint written
holds no pickle.

Layout (docs/interop.md, "How names map"). ``dcp.save`` flattens a nested state dict into dotted
keys and records, in the metadata's ``planner_data``, the real path of each
(``("optim", "state", "layers.0.weight", "exp_avg")``), so FQNs with dots are never split
wrongly; the import rebuilds the nested tree from those paths (without ``planner_data``, a
custom planner's, a key's first dotted component is its top-level name and the rest one FQN).
Each top-level key stays a state entry, of the kind ``_classify`` finds (an optimizer, also one
torchtitan flattened, is unflattened); tensors at the top level (torchtitan's model FQNs) are
gathered under ``--as`` (default ``model``).

Reading: tensors are loaded with ``dcp.load`` into full-size CPU tensors, in batches of at most
``BATCH_BYTES`` (one tensor if larger), without a process group; DCP reassembles each tensor from
however many ranks' chunks it was saved in.

Export: ``dcp.save`` with DCP's own ``FileSystemWriter`` of a state dict of ``meta`` stand-ins;
the planner reads each tensor from ckptd only when the writer asks for it, and each goes to a
file of its own, so one tensor is in memory at a time. The folder loads with ``dcp.load`` at any
world size and sharding (RNG states, which ckptd keeps per rank beside the state, are not
exported).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from ckptd.errors import CheckpointError
from ckptd.interop.common import (
    ExportResult,
    ImportTree,
    Item,
    Progress,
    SavedCheckpoint,
    _no_progress,
    check_output,
    one_line,
    staged_output,
    trim_heap,
)

__all__ = ["BATCH_BYTES", "read", "write"]

BATCH_BYTES = 16 * 1024 * 1024  # tensors loaded per dcp.load call (fewer calls, bounded memory)

# dcp.save/load warn when no process group is up; running in one process is what we mean.
_NO_DIST_WARNING = r"torch\.distributed is disabled"


class _Reader(FileSystemReader):
    """FileSystemReader that unpickles ``.metadata`` once, not once per ``dcp.load`` call."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _LoadPlanner(DefaultLoadPlanner):
    """Loads into a flat dict keyed by DCP keys; non-tensor values with ``weights_only=True``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=True)
        except Exception as e:  # an UnpicklingError naming the refused global, usually
            raise CheckpointError(
                f"value {fqn!r} is not plain data (tensors, numbers, strings, lists, dicts): {one_line(e)}"
            ) from None


def _load(sd: dict[str, Any], reader: _Reader, src: str) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(sd, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise _error(e, src, "cannot read DCP data") from None


def _error(e: BaseException, where: str, what: str) -> CheckpointError:
    """One line for a DCP failure. DCP wraps what its planner or storage raised in a
    ``CheckpointException`` (rank -> (exception, traceback)) whose text is a traceback."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    if isinstance(e, CheckpointError):
        return CheckpointError(f"{where}: {e}")
    return CheckpointError(f"{where}: {what} ({one_line(e)})")


def read(src: str, as_key: str = "model") -> tuple[ImportTree, Any]:
    """The tree of a DCP folder and its loader (see the module docstring for the mapping)."""
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise CheckpointError(f"{src}: not a PyTorch DCP checkpoint (no .metadata file)")
    reader = _Reader(src)
    try:
        md = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"{src}: cannot read DCP metadata ({one_line(e)})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{src}: .metadata does not hold DCP metadata")
    paths = _paths(md)
    tree = ImportTree(info={"format": "dcp", "path": os.path.abspath(src), "dcp_version": md.version})

    values: dict[str, Any] = {k: None for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if values:
        _load(values, reader, src)

    root: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            leaf = tree.placeholder(key, tuple(meta.size), meta.properties.dtype)
        else:
            leaf = values[key]
        _set_path(root, paths[key], leaf, src)

    top_tensors = {k: v for k, v in root.items() if isinstance(v, torch.Tensor)}
    if top_tensors:
        if as_key in root:
            raise CheckpointError(
                f"{src}: has tensors at the top level, which go under {as_key!r}, and also an entry "
                f"{as_key!r}; choose another name with --as"
            )
        tree.add(as_key, "dict", top_tensors)
    for name, value in root.items():
        if name not in top_tensors:
            kind, value = _classify(value)
            tree.add(name, kind, value)

    def load(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        batch: list[Item] = []
        size = 0
        for it in items:
            if batch and size + it.nbytes > BATCH_BYTES:
                yield from _load_batch(batch, reader, src)
                batch, size = [], 0
            batch.append(it)
            size += it.nbytes
        if batch:
            yield from _load_batch(batch, reader, src)

    return tree, load


def _load_batch(batch: list[Item], reader: _Reader, src: str) -> Iterator[tuple[Item, torch.Tensor]]:
    sd: dict[str, Any] = {it.source: torch.empty(it.shape, dtype=it.dtype) for it in batch}
    _load(sd, reader, src)
    for it in batch:
        yield it, sd.pop(it.source)  # dropped here, so the batch's memory goes as it is written


def _paths(md: Metadata) -> dict[str, tuple]:
    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for key in md.state_dict_metadata:
        path = mapping.get(key)
        if not isinstance(path, tuple | list) or not path:
            head, dot, rest = key.partition(".")
            path = (head, rest) if dot else (key,)
        out[key] = tuple(path)
    return out


def _set_path(root: dict, path: tuple, value: Any, src: str) -> None:
    """Put ``value`` at ``path`` (str components: dict keys; int components: list indices)."""
    cur: Any = root
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(cur, list):
            if not isinstance(part, int):
                raise CheckpointError(f"{src}: key path {path!r} mixes a list with a dict key")
            cur.extend([None] * (part + 1 - len(cur)))
            if last:
                cur[part] = value
            else:
                if cur[part] is None:
                    cur[part] = [] if isinstance(path[i + 1], int) else {}
                cur = cur[part]
        else:
            part = str(part) if i == 0 else part
            if last:
                if part in cur:
                    raise CheckpointError(f"{src}: key path {path!r} appears twice")
                cur[part] = value
            else:
                cur = cur.setdefault(part, [] if isinstance(path[i + 1], int) else {})
                if not isinstance(cur, dict | list):
                    raise CheckpointError(f"{src}: key path {path!r} runs through a value")


def _classify(value: Any) -> tuple[str, Any]:
    if isinstance(value, torch.Tensor):
        return "tensor", value
    if not isinstance(value, dict):
        return "value", value
    if set(value) == {"state", "param_groups"} and isinstance(value["state"], dict):
        return "optimizer", {"state": value["state"], "param_groups": value["param_groups"]}
    if value and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in value):
        return "optimizer", _unflatten_optimizer(value)
    return "dict", value


def _unflatten_optimizer(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<hp>": v}`` (torch's
    ``flatten_optimizer_state_dict``) -> ``{"state": {fqn: {name: v}}, "param_groups": [...]}``.
    State names and hyperparameter names hold no dot, so the FQN is everything between."""
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        section, _, rest = k.partition(".")
        fqn, _, name = rest.rpartition(".")
        (state if section == "state" else hyper).setdefault(fqn, {})[name] = v
    groups: list[dict[str, Any]] = []
    for fqn, hp in hyper.items():
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == hp:
            groups[-1]["params"].append(fqn)
        else:
            groups.append({**hp, "params": [fqn]})
    return {"state": state, "param_groups": groups}


class _LazySavePlanner(DefaultSavePlanner):
    """Hands DCP's writer each tensor's data when it asks for it, read from ckptd."""

    def __init__(self, saved: SavedCheckpoint, total: int, progress: Progress):
        super().__init__()
        self._saved = saved
        self._total = total
        self._done = 0
        self._progress = progress

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        stand_in = self.lookup_object(write_item.index)
        trim_heap()  # the previous tensor is written and dropped by now
        t = self._saved.read(self._saved.key_of(stand_in))
        chunk = write_item.tensor_data.chunk if write_item.tensor_data is not None else None
        if chunk is not None and tuple(chunk.sizes) != tuple(t.shape):  # plain tensors: one whole chunk
            for dim, (off, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                t = t.narrow(dim, off, n)
        self._done += 1
        self._progress(self._done, self._total)
        return t


def write(saved: SavedCheckpoint, out: str, progress: Progress = _no_progress) -> ExportResult:
    """Write every state entry of ``saved`` as a DCP folder ``out``; returns the files written."""
    check_output(out)
    state = {name: saved.decode(name)[1] for name in saved.names}
    total = len(saved.manifest.tensors)
    try:
        with staged_output(out) as tmp:
            # One file per item: torch's writer keeps every tensor of a file referenced until the file
            # is closed (torch 2.13), so one file per rank would hold the whole checkpoint in memory.
            writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1, sync_files=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                dcp.save(state, storage_writer=writer, planner=_LazySavePlanner(saved, total, progress), no_dist=True)
            files = sorted(os.listdir(tmp))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise _error(e, out, "DCP export failed") from None
    return ExportResult([os.path.join(out, f) for f in files], total)
