"""Checkpoints of other tools in and out of ckptd, one tensor at a time: ``dcp`` (Megatron
``torch_dist`` too), ``torch`` and ``safetensors`` both ways, ``deepspeed-universal`` import only
(docs/interop.md has what each reads and writes).

One module per format, each with ``read(src, as_key) -> (ImportTree, loader)`` and (except
DeepSpeed) ``write(saved, out, ...) -> ExportResult``; ``common`` holds the rest. Memory stays
near the largest tensor whatever the checkpoint's size: sources are read lazily, a tensor at a
time, and exports write each tensor as it is read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ckptd.errors import CheckpointError

if TYPE_CHECKING:  # torch is imported only when a command runs, so ``ckptd ls`` starts fast
    from ckptd.interop.common import ExportResult, ImportResult, Progress
    from storage_backends import Store

IMPORT_FORMATS = {"dcp": "dcp", "torch": "torchfile", "safetensors": "safetensors", "deepspeed-universal": "deepspeed"}
EXPORT_FORMATS = {"torch": "torchfile", "safetensors": "safetensors", "dcp": "dcp"}


def import_checkpoint(
    src: str,
    fmt: str,
    store: Store,
    step: int,
    as_key: str = "model",
    progress: Progress | None = None,
    *,
    trust_pickle: bool = False,
    max_tensors: int | None = None,
) -> ImportResult:
    """Write the checkpoint at ``src`` (format ``fmt``) into ``store`` as committed step ``step``.

    A DCP folder's ``.metadata`` is a pickle that only torch's unpickler reads, and unpickling can
    run code stored in it: ``dcp`` is refused unless the caller says it trusts ``src``
    (``trust_pickle=True``, ``ckptd import --trust-pickle``). The other formats unpickle nothing
    (``weights_only=True``). More than ``max_tensors`` tensors (default
    ``common.MAX_TENSORS``) is refused before anything is written."""
    from ckptd.interop.common import MAX_TENSORS, _no_progress, write_import

    max_tensors = MAX_TENSORS if max_tensors is None else max_tensors

    if fmt not in IMPORT_FORMATS:
        raise CheckpointError(f"unknown import format {fmt!r} (one of {', '.join(IMPORT_FORMATS)})")
    if fmt == "dcp" and not trust_pickle:
        raise CheckpointError(
            f"{src}: refusing to import DCP without --trust-pickle: a DCP folder's .metadata is a Python "
            "pickle and reading it can run code stored in it; pass --trust-pickle only for a folder you "
            "would torch.load"
        )
    module = importlib.import_module(f"ckptd.interop.{IMPORT_FORMATS[fmt]}")
    # safetensors counts its tensors from the headers, before making a stand-in for any
    tree, load = module.read(src, as_key, max_tensors) if fmt == "safetensors" else module.read(src, as_key)
    return write_import(store, step, tree, load, progress or _no_progress, max_tensors)


def export_checkpoint(
    store: Store,
    step: int | None,
    fmt: str,
    out: str,
    as_key: str = "model",
    max_shard_bytes: int | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write committed checkpoint ``step`` (the latest if None) of ``store`` to ``out``."""
    from ckptd.interop.common import SavedCheckpoint, _no_progress

    progress = progress or _no_progress
    if fmt not in EXPORT_FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    module = importlib.import_module(f"ckptd.interop.{EXPORT_FORMATS[fmt]}")
    with SavedCheckpoint(store, step) as saved:
        if fmt == "dcp":
            return module.write(saved, out, progress=progress)
        if fmt == "torch":
            return module.write(saved, out, as_key=as_key, progress=progress)
        return module.write(saved, out, as_key=as_key, max_shard_bytes=max_shard_bytes, progress=progress)


__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "export_checkpoint", "import_checkpoint"]
