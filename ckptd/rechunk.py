"""``ckptd reshard --rechunk``: copy a checkpoint into shards that match the restoring ranks.

The copy is a new committed checkpoint with the same step in its own job root,
``<root>/_rechunked/<to_M_layout>/`` (see :mod:`ckptd.plans` for why). Every tensor a layout
splits gets one shard per distinct rank block (:func:`ckptd.reshard.aligned_layout`), with inner
chunks that divide it, so a rank of the restoring job reads whole chunks only; the state tree is
copied as is. The checkpoint it reads is only ever read.

Memory stays bounded by one shard plus the writer's puts in flight: tensors are copied shard by
shard (read the box from the original with :class:`~ckptd.reader.CheckpointReader`, write it with
:class:`~ckptd.stream.CheckpointWriter`). The copy is verified (every chunk re-read and checked)
before the plan may point at it; a copy that fails is deleted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ckptd import catalog, pins
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.layout import Box
from ckptd.plans import rechunked_root, sub_uri
from ckptd.reader import CheckpointReader, ReadRequest
from ckptd.reshard import TargetLayout, aligned_layout, rank_boxes, sharded_keys
from ckptd.stream import CheckpointWriter
from ckptd.verify import verify
from storage_backends import StorageError, Store, open_store

__all__ = ["Rechunked", "find", "rechunk"]


@dataclass(frozen=True)
class Rechunked:
    """A rechunked copy: ``root`` relative to the job root, its ``uri``, and its manifest.
    ``reused``: an earlier run had written it already."""

    root: str
    uri: str
    manifest: mf.Manifest
    reused: bool

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def where(self) -> str:
        return f"{self.uri}/{mf.step_dir(self.step)}"


def _source_of(m: mf.Manifest) -> dict:
    return {"step": m.step, "attempt": m.attempt, "world_size": m.world_size}


def find(store: Store, m: mf.Manifest, target: TargetLayout) -> Rechunked | None:
    """The committed copy of checkpoint ``m`` for ``target``, if one exists and was made from
    this very checkpoint (same step and save attempt)."""
    root = rechunked_root(target)
    uri = sub_uri(store, root)
    with open_store(uri) as sub:
        if not sub.exists(f"{mf.step_dir(m.step)}/{mf.COMMIT}"):
            return None
        copy = catalog.load_manifest(sub, m.step)
    if copy.layout.get("rechunked_from") != _source_of(m):
        return None
    return Rechunked(root, uri, copy, reused=True)


def rechunk(
    store: Store,
    m: mf.Manifest,
    target: TargetLayout,
    *,
    threads: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Rechunked:
    """Write (or find) the copy of committed checkpoint ``m`` of ``store`` for ``target``."""
    existing = find(store, m, target)
    if existing is not None:
        return existing
    root = rechunked_root(target)
    uri = sub_uri(store, root)
    sharded = sharded_keys(m.tensors)
    layouts = {
        key: aligned_layout(
            e.layout.shape, e.layout.dtype, e.layout.itemsize, rank_boxes(e.layout.shape, key in sharded, target)
        )
        for key, e in m.tensors.items()
    }
    total = sum(sum(1 for _ in lay.shard_coords()) for lay in layouts.values() if lay.nbytes)
    reader = CheckpointReader(store, mf.step_dir(m.step), catalog.where(store, m.step), pins.committed(store, m.step))
    info = {"world_size": target.world_size, "layout": target.to_json(), "rechunked_from": _source_of(m)}
    done = 0
    with open_store(uri) as sub:
        if sub.exists(f"{mf.step_dir(m.step)}/{mf.COMMIT}"):
            # A copy of an older checkpoint of the same step (deleted and saved again): stale.
            catalog.delete_checkpoint(sub, m.step)
        with (
            ThreadPoolExecutor(threads, thread_name_prefix="ckptd-rechunk") as pool,
            CheckpointWriter(sub, m.step, world_size=target.world_size, layout_info=info, threads=threads) as w,
        ):
            for key, e in m.tensors.items():
                lay = layouts[key]
                w.declare(key, lay, e.placements)
                if not lay.nbytes:
                    continue
                for coord in lay.shard_coords():
                    box = Box(*lay.shard_box(coord))
                    block = np.empty(box.shape, dtype=lay.np_dtype)
                    reader.read([ReadRequest(e, box, block)], pool)
                    w.write_shard(key, coord, block)
                    done += 1
                    if progress:
                        progress(done, total)
            w.set_state(m.state)
            w.commit({"rechunked_from": _source_of(m)})
        report = verify(sub, m.step, threads=threads)
        if not report.ok:
            with contextlib.suppress(StorageError):
                catalog.delete_checkpoint(sub, m.step)
            raise CheckpointError(f"rechunked copy failed verification, deleted: {report.errors[0]}")
        copy = catalog.load_manifest(sub, m.step)
    return Rechunked(root, uri, copy, reused=False)
