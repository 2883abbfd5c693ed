"""safetensors files: import a file or a Hugging Face-style sharded folder, or export one entry.

Import: SRC is a ``.safetensors`` file, a folder with ``model.safetensors.index.json`` (its
``weight_map`` names every tensor's shard), the index file itself, or a folder holding exactly
one ``.safetensors`` file. Shapes and dtypes come from the headers; each tensor is read with
``safe_open(...).get_tensor`` when it is written, and the mapping's pages are released after it.
Tensors land under ``--as`` (default ``model``) with their names as FQNs; the header's
``__metadata__`` is recorded in the manifest's ``layout.imported_from``.

Export writes entry ``--as`` (FQN names; deeper paths joined with ``.``) as safetensors. The
format is a little-endian u64 header length, a JSON header (dtype, shape, byte offsets per
tensor, padded with spaces to 8 bytes) and the tensors' bytes in header order; because the header
needs only shapes and dtypes, each file is written from tensors read one at a time. With
``--max-shard-size`` the tensors are split (``shard``) into ``model-00001-of-0000N.safetensors``
files plus ``model.safetensors.index.json``, as Hugging Face writes them; OUT is then a folder.
Non-tensor values (an optimizer's hyperparameters) cannot be stored and are left out.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ckptd import manifest as mf
from ckptd.dtypes import as_numpy
from ckptd.errors import CheckpointError
from ckptd.interop.common import (
    MAX_TENSORS,
    TRIM_BYTES,
    ExportResult,
    ImportTree,
    Item,
    Progress,
    SavedCheckpoint,
    _no_progress,
    check_count,
    check_output,
    flat_tensors,
    release_file_pages,
    staged_output,
    trim_heap,
)
from storage_backends import NotFoundError, StorageError, open_store

__all__ = ["INDEX", "MAX_INDEX_BYTES", "SINGLE", "read", "shard", "write"]

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # an index of 100,000 tensors is about 10 MB
SINGLE = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    # The float8 types that safetensors' torch side (0.8) reads; float8_e8m0fnu and
    # float4_e2m1fn_x2 it does not, so an export of them is refused (``write``).
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - an optional extra
        raise CheckpointError("safetensors is not installed: pip install 'ckptd[interop]'") from None
    return safe_open


def _files(src: str) -> tuple[list[str], dict[str, str] | None]:
    """The shard files and, for an indexed folder, its weight map (name -> file)."""
    if os.path.isdir(src):
        index = os.path.join(src, INDEX)
        if os.path.isfile(index):
            return _from_index(index)
        found = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        if len(found) != 1:
            raise CheckpointError(
                f"{src}: folder has no {INDEX} and {len(found)} .safetensors files; name the file or add the index"
            )
        return [os.path.join(src, found[0])], None
    if src.endswith(".json") and os.path.isfile(src):
        return _from_index(src)
    if not os.path.isfile(src):
        raise CheckpointError(f"{src}: no such file or folder")
    return [src], None


def _from_index(index: str) -> tuple[list[str], dict[str, str]]:
    # Read as every record is: through a store (no link, no FIFO), capped before reading.
    folder, name = os.path.split(os.path.abspath(index))
    try:
        doc = mf.read_json(open_store(folder), name, index, "safetensors index", MAX_INDEX_BYTES)
        weight_map = doc["weight_map"]
    except NotFoundError:
        raise CheckpointError(f"{index}: no such file (or not a regular file)") from None
    except (StorageError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not an object")
    folder = os.path.dirname(index)
    files = []
    for name in dict.fromkeys(weight_map.values()):
        path = os.path.join(folder, name)
        if os.path.basename(name) != name or not os.path.isfile(path):
            raise CheckpointError(f"{index}: shard {name!r} is missing")
        files.append(path)
    return files, weight_map


def read(src: str, as_key: str = "model", max_tensors: int = MAX_TENSORS) -> tuple[ImportTree, Any]:
    """The tree of ``src``'s tensors. More than ``max_tensors`` in all is refused as soon as a
    header is read, before a stand-in is made for any."""
    safe_open = _safe_open()
    files, weight_map = _files(src)
    tree = ImportTree(info={"format": "safetensors", "path": os.path.abspath(src)})
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                md = f.metadata()
                if md:
                    metadata[os.path.basename(path)] = dict(md)
                names = f.keys()  # a safe_open handle is not iterable
                check_count(len(tensors) + len(names), max_tensors, path)
                for name in names:
                    if weight_map is not None and weight_map.get(name) != os.path.basename(path):
                        continue  # the index says another shard holds it
                    if name in tensors:
                        raise CheckpointError(f"{src}: tensor {name!r} is in two shards")
                    sl = f.get_slice(name)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has dtype {sl.get_dtype()}, which ckptd cannot store"
                        )
                    tensors[name] = tree.placeholder((path, name), sl.get_shape(), dtype)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises SafetensorError (a bare Exception) on bad files
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{src}: index names {missing[0]!r} but its shard does not hold it")
    if metadata:
        tree.info["metadata"] = metadata
    tree.add(as_key, "dict", tensors)

    def load(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        handles: dict[str, Any] = {}
        touched: dict[str, int] = {}  # bytes read from each file since its pages were released
        try:
            for it in items:
                path, name = it.source
                if path not in handles:
                    handles[path] = safe_open(path, framework="pt").__enter__()
                yield it, handles[path].get_tensor(name)
                touched[path] = touched.get(path, 0) + it.nbytes
                if touched[path] >= TRIM_BYTES:  # not per tensor: each release reads the mappings
                    release_file_pages(path)
                    touched[path] = 0
            for path, n in touched.items():
                if n:
                    release_file_pages(path)
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)

    return tree, load


def shard(names: list[str], sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Hugging Face's greedy split: tensors in order; a new shard when the next one would
    overflow the current (a tensor larger than ``max_bytes`` gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if max_bytes is not None and shards[-1] and size + sizes[n] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += sizes[n]
    return shards


def _header(names: list[str], stand_ins: dict[str, torch.Tensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in names:
        t = stand_ins[n]
        size = t.nbytes
        header[n] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_file(path: str, names: list[str], stand_ins, saved: SavedCheckpoint, tick) -> None:
    header = _header(names, stand_ins)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for n in names:
            t = stand_ins[n]
            if t.numel():
                data = saved.read(saved.key_of(t))
                f.write(memoryview(as_numpy(data).reshape(-1).view("u1")))
                del data
                trim_heap()
            tick()
        f.flush()
        os.fsync(f.fileno())


def write(
    saved: SavedCheckpoint,
    out: str,
    as_key: str = "model",
    max_shard_bytes: int | None = None,
    progress: Progress = _no_progress,
) -> ExportResult:
    """Write entry ``as_key`` of ``saved``: one file ``out`` (a path ending ``.safetensors``,
    unsharded), else a folder ``out`` with ``model.safetensors`` or shards and an index."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise CheckpointError("safetensors export needs a little-endian machine")
    check_output(out)
    stand_ins, skipped = flat_tensors(saved, as_key)
    for n, t in stand_ins.items():
        if t.dtype not in _NAMES:
            raise CheckpointError(
                f"{saved.where}: tensor {n!r} has dtype {t.dtype}, which safetensors cannot hold "
                f"(it holds {', '.join(str(d).removeprefix('torch.') for d in _NAMES)}); "
                "export with --format torch (a torch.save file) or dcp instead"
            )
    names = list(stand_ins)
    sizes = {n: stand_ins[n].nbytes for n in names}
    shards = shard(names, sizes, max_shard_bytes)
    single_file = out.endswith(".safetensors")
    if single_file and len(shards) > 1:
        raise CheckpointError(f"{out}: a sharded export goes to a folder; give OUT without .safetensors")
    ticks = itertools.count(1)
    tick = lambda: progress(next(ticks), len(names))

    with staged_output(out) as tmp:
        progress(0, len(names))
        if single_file:
            _write_file(tmp, names, stand_ins, saved, tick)
            return ExportResult([out], len(names), skipped)
        os.mkdir(tmp)
        if len(shards) == 1:
            files = [SINGLE]
        else:
            files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for fname, part in zip(files, shards, strict=True):
            _write_file(os.path.join(tmp, fname), part, stand_ins, saved, tick)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {n: f for f, part in zip(files, shards, strict=True) for n in part},
            }
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
            files.append(INDEX)
    return ExportResult([os.path.join(out, f) for f in files], len(names), skipped)
