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
from collections.abc import Iterator
from typing import Any

import torch

from ckptd.errors import CheckpointError
from ckptd.interop.common import (
    ExportResult,
    ImportTree,
    Item,
    Progress,
    SavedCheckpoint,
    _no_progress,
    check_output,
    flat_tensors,
    partial_path,
    publish,
    release_file_pages,
    remove_partial,
)


def _torch_load(path: str, mmap_: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap_)
    except pickle.UnpicklingError as e:
        first = str(e).split("\n\n")[0].split("\n")[0]
        raise CheckpointError(
            f"{path}: holds objects other than tensors and plain values ({first}); ckptd never "
            "unpickles arbitrary objects: load it yourself and torch.save its state dict"
        ) from None


def read(src: str, as_key: str = "model") -> tuple[ImportTree, Any]:
    if not os.path.isfile(src):
        raise CheckpointError(f"{src}: no such file")
    mapped = True
    try:
        obj = _torch_load(src, mmap_=True)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, OSError, EOFError) as e:
        if "mmap" not in str(e):  # not the legacy format: not a torch.save file at all
            raise CheckpointError(f"{src}: not a readable torch.save file ({_one_line(e)})") from None
        try:
            obj = _torch_load(src, mmap_=False)  # legacy format: read whole
        except (RuntimeError, ValueError, OSError, EOFError) as e2:
            raise CheckpointError(f"{src}: not a readable torch.save file ({_one_line(e2)})") from None
        mapped = False
    if not isinstance(obj, dict):
        raise CheckpointError(f"{src}: holds a {type(obj).__name__}, not a state dict")
    tree = ImportTree(info={"format": "torch", "path": os.path.abspath(src)})
    tree.add(as_key, "dict", dict(obj))

    def load(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
        for it in items:
            yield it, it.source
            if mapped:
                release_file_pages(src)

    return tree, load


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


def write(saved: SavedCheckpoint, out: str, as_key: str = "model", progress: Progress = _no_progress) -> ExportResult:
    """Write entry ``as_key`` of ``saved`` as one ``torch.save`` file ``out``."""
    check_output(out)
    stand_ins, skipped = flat_tensors(saved, as_key)
    tmp = partial_path(out)
    try:
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
            progress(i + 1, len(stand_ins))
        del mapped
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        publish(tmp, out)
    except BaseException:
        remove_partial(tmp)
        raise
    return ExportResult([out], len(stand_ins), skipped)
