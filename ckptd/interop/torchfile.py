"""``torch.save`` files of a state dict: import one, or export one entry of a checkpoint as one.

Import reads the file with ``torch.load(weights_only=True, mmap=True)``: torch's restricted
unpickler (tensors and plain containers and values only, never arbitrary code), and tensors
that stay in the file until touched. The whole dict lands under one state name (``--as``,
default ``model``), so a flat ``module.state_dict()`` restores into ``{"model": module}``;
non-tensor values are kept as JSON. A file in the legacy (pre-1.6, non-zip) format cannot be
mapped and is read whole.

Export writes one state entry (``--as``) as a flat dict (FQN keys; deeper paths joined with
``.``) that ``torch.load`` reads back. It streams too: ``torch.serialization.skip_data`` writes
the file with every tensor's bytes left blank, the file is then mapped shared
(``torch.load(mmap=True)`` with ``MAP_SHARED``) and each tensor is copied in as it is read from
ckptd, its pages released once written.
"""

from __future__ import annotations

import mmap
import os
import pickle
import re
from collections.abc import Iterator
from typing import Any

import torch

from ckptd.errors import CheckpointError
from ckptd.interop.common import (
    TRIM_BYTES,
    ExportResult,
    ImportTree,
    Item,
    Progress,
    SavedCheckpoint,
    _no_progress,
    check_output,
    flat_tensors,
    one_line,
    release_file_pages,
    staged_output,
    trim_heap,
)

__all__ = ["Opaque", "read", "safe_load", "write"]


class Opaque:
    """What an allow-listed foreign class (``safe_load(stand_ins=...)``) unpickles as: an inert
    record of the arguments and attributes the pickle gave it. It runs no code of that class, so
    a pickle can name the class but not make ckptd call anything."""

    def __init__(self, *args: Any) -> None:
        self.args = args


def safe_load(path: str, mmap_: bool = True, stand_ins: tuple[str, ...] = ()) -> tuple[Any, bool]:
    """``torch.load(weights_only=True)`` with its failures as one-line CheckpointErrors; returns
    the object and whether it is memory-mapped (a legacy-format file is read whole).
    ``stand_ins``: fully qualified class names that unpickle as ``Opaque`` records instead of
    being refused (a format's known bookkeeping objects next to the values ckptd reads)."""
    try:
        with torch.serialization.safe_globals([(Opaque, name) for name in stand_ins]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap_), mmap_
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if refused:
            raise CheckpointError(
                f"{path}: holds an object of type {refused.group(1)}, not only tensors and plain values; "
                "ckptd never unpickles arbitrary objects: load it yourself and torch.save its state dict"
            ) from None
        raise CheckpointError(f"{path}: not a readable torch.save file ({one_line(e)})") from None
    except (RuntimeError, ValueError, OSError, EOFError) as e:
        if mmap_ and "mmap can only be used" in str(e):
            return safe_load(path, mmap_=False, stand_ins=stand_ins)
        raise CheckpointError(f"{path}: not a readable torch.save file ({one_line(e)})") from None


def read(src: str, as_key: str = "model") -> tuple[ImportTree, Any]:
    if not os.path.isfile(src):
        raise CheckpointError(f"{src}: no such file")
    obj, mapped = safe_load(src)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{src}: holds a {type(obj).__name__}, not a state dict")
    tree = ImportTree(info={"format": "torch", "path": os.path.abspath(src)})
    tree.add(as_key, "dict", dict(obj))

    def load(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        touched = 0  # bytes read since the mapping's pages were released: per 16 MiB, not per tensor
        for it in items:
            yield it, it.source
            touched += it.nbytes
            if mapped and touched >= TRIM_BYTES:
                release_file_pages(src)
                touched = 0
        if mapped and touched:
            release_file_pages(src)

    return tree, load


def write(saved: SavedCheckpoint, out: str, as_key: str = "model", progress: Progress = _no_progress) -> ExportResult:
    """Write entry ``as_key`` of ``saved`` as one ``torch.save`` file ``out``."""
    check_output(out)
    stand_ins, skipped = flat_tensors(saved, as_key)
    with staged_output(out) as tmp:
        # Untouched torch.empty tensors cost address space, not memory; skip_data never reads them.
        skeleton = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in stand_ins.items()}
        with torch.serialization.skip_data():
            torch.save(skeleton, tmp)
        del skeleton
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
        progress(0, len(stand_ins))
        for i, (name, t) in enumerate(stand_ins.items()):
            if t.numel():
                mapped[name].copy_(saved.read(saved.key_of(t)))
                release_file_pages(tmp)  # shared mapping: the bytes stay in the page cache
                trim_heap()
            progress(i + 1, len(stand_ins))
        del mapped
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    return ExportResult([out], len(stand_ins), skipped)
