"""The checkpoints of a job root: listing, opening and deleting (committing is ``ckptd.commit``,
retention ``ckptd.retention``).

Readers go through here so that nothing ever opens a checkpoint without its commit record.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ckptd import donetree, latest
from ckptd.errors import CheckpointError, CheckpointNotFoundError
from ckptd.manifest import (
    COMMIT,
    DONE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_step_dir,
    read_json,
    step_dir,
)
from storage_backends import NotFoundError, StorageError, Store


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    committed: bool
    world_size: int | None
    bytes: int | None
    time: float | None
    path: str  # folder relative to the job root
    # a partial step: the bytes its arrays take once complete (from its manifest), None if unknown
    expected_bytes: int | None = None

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("step", "committed", "world_size", "bytes", "time")}
        return {**out, "checkpoint_path": self.path, "expected_bytes": self.expected_bytes}


def _root_dirs(store: Store) -> list[str]:
    try:
        return store.list_dir("")[1]
    except StorageError as e:
        raise CheckpointError(f"{store.uri}: cannot list job root ({e})") from None


def steps(store: Store) -> list[int]:
    """Every step that has a folder, committed or not, ascending."""
    return sorted(s for d in _root_dirs(store) if (s := parse_step_dir(d)) is not None)


def ignored_names(store: Store) -> list[str]:
    """Folders of the job root that look like checkpoints (``step_...``) but are not named
    ``step_`` + exactly ten ASCII digits: nothing lists, restores or deletes them; ``ls`` names
    them so an operator sees them."""
    return [d for d in _root_dirs(store) if d.lower().startswith("step") and parse_step_dir(d) is None]


def read_commit(store: Store, step: int) -> dict | None:
    try:
        rec = read_json(store, f"{step_dir(step)}/{COMMIT}", where(store, step), "commit record")
    except NotFoundError:
        return None
    if not isinstance(rec, dict):
        raise CheckpointError(f"{where(store, step)}: commit record is not a JSON object")
    return rec


def committed_steps(store: Store) -> list[int]:
    return [s for s in steps(store) if store.exists(f"{step_dir(s)}/{COMMIT}")]


def latest_step(store: Store) -> int | None:
    """The newest committed step: from the chain of ``ckptd.latest`` (3 requests whatever the
    number of steps), else by listing the root (:func:`latest_step_by_listing`)."""
    answered, step = latest.latest_from_chain(store)
    return step if answered else latest_step_by_listing(store)


def latest_step_by_listing(store: Store) -> int | None:
    """The newest committed step by listing every step folder (one request per 1000 steps on
    S3), then checking from the newest down, so usually one existence check."""
    return next((s for s in reversed(steps(store)) if store.exists(f"{step_dir(s)}/{COMMIT}")), None)


def list_checkpoints(store: Store) -> list[CheckpointInfo]:
    out = []
    for s in steps(store):
        commit = read_commit(store, s)
        if commit is not None:
            nums = [_num(commit.get(k), kind) for k, kind in (("world_size", int), ("bytes", int), ("time", float))]
            out.append(CheckpointInfo(s, True, *nums, step_dir(s)))
            continue
        objs = list(store.list(f"{step_dir(s)}/"))
        if not objs:
            # A folder with no object in it (what a writer killed before its first put finished
            # leaves: temp files, empty folders) is no checkpoint, not even a partial one; the
            # next save of that step or ``gc`` removes it.
            continue
        ws = expected = None
        with contextlib.suppress(NotFoundError, CheckpointError, StorageError):
            data = store.get(f"{step_dir(s)}/{MANIFEST}", limit=MAX_MANIFEST_BYTES)
            m = Manifest.from_bytes(data, where(store, s))
            ws, expected = m.world_size, _stored_bytes(m)
        size, mtime = sum(o.size for o in objs), max(o.mtime for o in objs)
        out.append(CheckpointInfo(s, False, ws, size, mtime, step_dir(s), expected))
    return out


def _stored_bytes(m: Manifest) -> int:
    """The bytes the shard objects of ``m``'s arrays take once written (each present chunk with
    its crc32c, and the shard index), so a partial step shows how far it got. Metadata objects
    (a few KiB) are not counted."""
    return sum(
        entry.layout.object_nbytes(coord)
        for entry in m.tensors.values()
        if entry.layout.nbytes and entry.value is None
        for coord in entry.layout.shard_coords()
    )


def _num(x, kind):
    """A commit record's number for display, or None when the record holds something else."""
    if isinstance(x, bool) or not isinstance(x, int | float) or (kind is int and not isinstance(x, int)):
        return None
    return x if kind is int or 0 <= x < 1e11 else None


def where(store: Store, step: int) -> str:
    return f"{store.uri.rstrip('/')}/{step_dir(step)}"


def resolve_step(store: Store, step: int | None) -> int:
    """``step`` if it is committed, the latest committed step if None; else a clear error."""
    if step is None:
        s = latest_step(store)
        if s is None:
            raise CheckpointNotFoundError(f"{store.uri}: no committed checkpoint")
        return s
    if store.exists(f"{step_dir(step)}/{COMMIT}"):
        return step
    if store.exists(f"{step_dir(step)}/{MANIFEST}") or any(True for _ in store.list(f"{step_dir(step)}/")):
        raise CheckpointNotFoundError(f"{where(store, step)}: checkpoint is partial (never committed)")
    raise CheckpointNotFoundError(f"{where(store, step)}: no such checkpoint")


def load_manifest(store: Store, step: int | None = None) -> Manifest:
    """The manifest of a committed checkpoint (the latest if ``step`` is None)."""
    return read_manifest(store, resolve_step(store, step))[1]


def read_manifest(store: Store, step: int) -> tuple[bytes, Manifest]:
    """(the bytes, the manifest) of committed ``step``: CheckpointError if it is missing,
    unreadable, malformed or names another step."""
    try:
        data = store.get(f"{step_dir(step)}/{MANIFEST}", limit=MAX_MANIFEST_BYTES)
    except NotFoundError:
        raise CheckpointError(f"{where(store, step)}: committed but the manifest is missing") from None
    except StorageError as e:
        raise CheckpointError(f"{where(store, step)}: cannot read the manifest ({e})") from None
    m = Manifest.from_bytes(data, where(store, step))
    if m.step != step:
        raise CheckpointError(f"{where(store, step)}: manifest says step {m.step}")
    return data, m


def delete_checkpoint(store: Store, step: int) -> tuple[int, int]:
    """Delete one checkpoint folder, with whatever a killed writer left in it (temp files,
    empty folders); returns (files, bytes) removed. The commit record goes first, so a
    half-deleted checkpoint reads as partial, never as a committed checkpoint with holes."""
    key = f"{step_dir(step)}/{COMMIT}"
    try:
        size = store.head(key).size
    except NotFoundError:
        size = None
    store.delete(key)
    files, nbytes = store.purge(f"{step_dir(step)}/")
    return (files + 1, nbytes + size) if size is not None else (files, nbytes)


# Rank's done record, in the done tree or (checkpoints older than it) the flat layout.
read_done_record = donetree.read_done_record
done_record_key = donetree.done_record_key


__all__ = [
    "CheckpointInfo",
    "DONE",
    "committed_steps",
    "delete_checkpoint",
    "ignored_names",
    "latest_step",
    "latest_step_by_listing",
    "read_done_record",
    "done_record_key",
    "list_checkpoints",
    "load_manifest",
    "resolve_step",
    "steps",
]
