"""The checkpoint folder: its names, the manifest, done records and the commit record.

::

    <job root>/
      step_0000000100/
        manifest.json          tensor table + non-tensor state (rank 0 writes it, before its done record)
        zarr.json              a zarr v3 group, so zarr tools can open the folder
        arrays/<key>/zarr.json one zarr v3 array per tensor, global shape
        arrays/<key>/c/...     shards (one per saving block) or plain chunks
        _claims/000000.json, 000001.json ...
                               claims: (writer, attempt); the newest owns the step
                               (``ckptd.commit``, put_if_absent, never deleted)
        _claims/<attempt>/000002/go.json
                               rank 0's claim outcome for ranks 128-191 of the attempt: go, or
                               the refusal and its error; the other ranks poll it instead of
                               claiming (not a claim; readers of claims skip it)
        _done/<attempt>/t1/000000/r000003.<bytes>.<objects>.<digest>.json
                               rank 3 finished: its data is durable (+ its RNG state and the
                               shard keys it wrote; <digest>: a 64-bit sum of their hashes)
        _done/<attempt>/t2/000000/n000001.<bytes>.<objects>.<digest>.json
                               ranks 64-127 all finished (only above 64 ranks): their sums
        commit.json            written last, once, with put_if_absent: the checkpoint exists
        _done/<attempt>/c0000/committed.json, c0001/...
                               above 1024 ranks, notices written after commit.json, one per
                               1024 ranks, that the waiting ranks poll (``donetree.notice_keys``)
      _latest/first.json, _latest/after_<step>.json, _latest/hint.json
                               the chain latest_step walks (``ckptd.latest``)
      _daemons/<id>.json       a node daemon's discovery record (``ckptd.server.discovery``):
                               not a checkpoint; listings of steps never see it

A folder without ``commit.json`` is partial: nothing restores it, ``ls`` shows it as partial.
The commit protocol needs no process group (``ckptd.commit``, ``ckptd.donetree``). Older
layouts stay readable: flat done records ``_done/<attempt>/rank_00003.json`` (``ckptd.donetree``)
and roots without ``_latest/`` (``ckptd.latest``).
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from ckptd import FORMAT_VERSION
from ckptd.codec import ArrayLayout
from ckptd.errors import CheckpointError

__all__ = [
    "ARRAYS",
    "CLAIMS",
    "COMMIT",
    "DAEMONS",
    "DONE",
    "GROUP",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_RECORD_BYTES",
    "Manifest",
    "PLANS",
    "STEP_RE",
    "TensorEntry",
    "array_path",
    "done_key",
    "is_reserved",
    "dumps",
    "escape_component",
    "group_metadata",
    "group_nodes",
    "is_count",
    "key_of",
    "loads",
    "parse_step_dir",
    "read_json",
    "step_dir",
    "unescape_component",
]

# Exactly ten ASCII digits: ``\d`` would also take Unicode digits, and a longer name would sort
# and parse as another step than the folder it names (retention deleted real steps that way).
STEP_RE = re.compile(r"step_([0-9]{10})", re.ASCII)
# Size caps on the JSON objects a reader loads, checked before they are read (``Store.get``'s
# ``limit``): a manifest holds the tensor table and the non-tensor state; records are small.
MAX_MANIFEST_BYTES = 256 << 20
MAX_RECORD_BYTES = 16 << 20  # commit.json, done records (with every rank's RNG state), zarr.json, plans
MANIFEST = "manifest.json"
COMMIT = "commit.json"
GROUP = "zarr.json"
ARRAYS = "arrays"
DONE = "_done"
CLAIMS = "_claims"  # <step>/_claims/<n>.json: who owns the step (ckptd.claims); <attempt>/<g>/go.json: outcomes
PLANS = "_plans"
DAEMONS = "_daemons"  # <job root>/_daemons/<id>.json: node daemons' discovery records (server.discovery)


MAX_STEP = 10**10 - 1  # a step folder names its step in exactly 10 digits
MAX_WRITER_RUNS = 1 << 16  # runs of a tensor entry's ``writers`` (more: no mapping is kept)


def step_dir(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if step > MAX_STEP:
        raise CheckpointError(f"step must be at most {MAX_STEP} (10 digits), got {step}")
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step a folder name stands for, or None for any other name (those are ignored)."""
    m = STEP_RE.fullmatch(name.removesuffix("/"))
    return int(m.group(1)) if m else None


def is_reserved(key: str) -> bool:
    """Whether ``key`` (relative to a step folder) belongs to the commit protocol -- the commit
    record, done records, claims -- or names the daemons' discovery folder (``DAEMONS``, kept
    out of every part so that no metadata can look like a daemon record), and so may not be
    written as a part's metadata."""
    return key == COMMIT or key.startswith((f"{DONE}/", f"{CLAIMS}/", f"{DAEMONS}/"))


def done_key(step: int, attempt: str, rank: int) -> str:
    """Rank's done record in the flat layout of checkpoints older than the done tree: nothing
    writes it any more; ``ckptd.donetree`` reads it where the tree has no record."""
    return f"{step_dir(step)}/{DONE}/{attempt}/rank_{rank:06d}.json"


@functools.lru_cache(maxsize=65536)  # every save escapes the same keys again
def escape_component(c: str) -> str:
    """One path component of a state key, safe as a file name and an S3 key part."""
    if c == "":
        return "%EMPTY"
    q = quote(c, safe="")
    return q.replace(".", "%2E") if q in (".", "..") else q


def unescape_component(c: str) -> str:
    return "" if c == "%EMPTY" else unquote(c)


def key_of(path: tuple[str, ...]) -> str:
    """The array key of a state path (``("model", "fc.weight")`` -> ``"model/fc.weight"``)."""
    return "/".join(escape_component(p) for p in path)


def array_path(key: str) -> str:
    """The array's folder relative to the checkpoint folder."""
    return f"{ARRAYS}/{key}"


@dataclass(frozen=True)
class TensorEntry:
    key: str
    layout: ArrayLayout
    placements: str = ""  # how it was sharded at save, for humans (``ckptd show``)
    # A 0-d array saved without a chunk object: its value (``codec.inline_value``), which is also
    # the ``fill_value`` of its zarr.json, so zarr readers see the same number.
    value: Any = None
    # Which rank wrote which shard (``layout.Grid.writer_runs``): runs (first shard in C order,
    # its rank, count), ranks consecutive within a run. A restore reads the pins of those ranks'
    # done records only (``ckptd.pins``); None (older checkpoints, ``CheckpointWriter``): all.
    writers: tuple[tuple[int, int, int], ...] | None = None

    @property
    def path(self) -> str:
        return array_path(self.key)

    def writer_of(self, shard_index: int) -> int | None:
        """The rank that wrote the shard at C-order index ``shard_index``, or None if unknown."""
        if self.writers is None:
            return None
        for first, rank, count in self.writers:  # few runs: one or two per tensor
            if first <= shard_index < first + count:
                return rank + shard_index - first
        return None

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "path": self.path,
            **self.layout.to_json(),
            "nbytes": self.layout.nbytes,
            "placements": self.placements,
            **({} if self.value is None else {"value": self.value}),
            **({} if self.writers is None else {"writers": [list(r) for r in self.writers]}),
        }

    @classmethod
    def from_json(cls, d: dict) -> TensorEntry:
        writers = d.get("writers")
        if writers is not None:
            if not isinstance(writers, list) or len(writers) > MAX_WRITER_RUNS:
                raise ValueError("writers must be a list of at most 2**16 runs")
            if not all(isinstance(r, list) and len(r) == 3 and all(is_count(x) for x in r) for r in writers):
                raise ValueError("writers must hold [first shard, rank, count] runs of non-negative integers")
            writers = tuple(tuple(r) for r in writers)
        return cls(d["key"], ArrayLayout.from_json(d), d.get("placements", ""), d.get("value"), writers)


@dataclass
class Manifest:
    step: int
    world_size: int
    tensors: dict[str, TensorEntry]
    state: dict[str, Any]  # jsonenc-encoded tree of the non-tensor state, with $tensor refs
    attempt: str = ""
    created: float = field(default_factory=time.time)
    layout: dict[str, Any] = field(default_factory=dict)  # how the job was laid out at save
    format_version: int = FORMAT_VERSION
    # Not stored: whether the commit record has pins for readers to check (``ckptd.pins``).
    pinned: bool = field(default=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.layout.nbytes for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        fields = ("format_version", "step", "world_size", "attempt", "created", "layout")
        head = json.dumps({"format": "ckptd", **{k: getattr(self, k) for k in fields}}, separators=(",", ":"))
        tensors = _tensors_json(tuple(self.tensors.values()))
        state = json.dumps(self.state, separators=(",", ":"))
        return f'{head[:-1]},"tensors":{tensors},"state":{state}}}'.encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and type-check a manifest read from a checkpoint (which may be hostile): every
        problem is a CheckpointError naming ``where``."""
        d = loads(data, where, "manifest")
        if not isinstance(d, dict) or d.get("format") != "ckptd":
            raise CheckpointError(f"{where}: not a ckptd manifest")
        bad = _bad_fields(d)
        if bad:
            raise CheckpointError(f"{where}: malformed manifest ({bad})")
        if d.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: format version {d['format_version']} is newer than this ckptd "
                f"({FORMAT_VERSION}); upgrade ckptd"
            )
        try:
            tensors = {t["key"]: TensorEntry.from_json(t) for t in d["tensors"]}
            if len(tensors) != len(d["tensors"]):
                raise ValueError("a tensor key appears twice")
            return cls(
                step=d["step"],
                world_size=d["world_size"],
                tensors=tensors,
                state=d["state"],
                attempt=d.get("attempt", ""),
                created=d.get("created", 0.0),
                layout=d.get("layout", {}),
                format_version=d["format_version"],
            )
        except (KeyError, TypeError, ValueError, AttributeError, CheckpointError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({e})") from None


def _bad_fields(d: dict) -> str | None:
    """What is wrong with the types of a manifest's fields, or None."""
    if not is_count(d.get("format_version"), 0):
        return "format_version must be a non-negative integer"
    if not is_count(d.get("step"), 0, 10**10 - 1):
        return "step must be an integer of at most 10 digits"
    if not is_count(d.get("world_size"), 1, 1 << 24):
        return "world_size must be a positive integer"
    if not isinstance(d.get("attempt", ""), str) or not isinstance(d.get("layout", {}), dict):
        return "attempt must be a string and layout an object"
    created = d.get("created", 0.0)
    if not isinstance(created, int | float) or isinstance(created, bool):
        return "created must be a number"
    tensors, state = d.get("tensors"), d.get("state")
    if not isinstance(tensors, list) or not all(isinstance(t, dict) and isinstance(t.get("key"), str) for t in tensors):
        return "tensors must be a list of objects with a string key"
    for t in tensors:
        for f in ("shape", "shard_shape", "chunk_shape"):
            if not isinstance(t.get(f), list):
                return f"tensor {t['key']!r}: {f} must be a list"
        if not isinstance(t.get("dtype"), str) or not isinstance(t.get("placements", ""), str):
            return f"tensor {t['key']!r}: dtype and placements must be strings"
    if not isinstance(state, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("kind"), str) for v in state.values()
    ):
        return "state must map each name to an object with a string kind"
    return None


def loads(data: bytes, where: str, what: str = "record") -> Any:
    """Parse JSON read from a checkpoint: CheckpointError on anything wrong with it (not JSON,
    nested too deep, not UTF-8), never a raw ValueError or RecursionError."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: {what} is not valid JSON ({type(e).__name__})") from None


def read_json(store, key: str, where: str, what: str = "record", limit: int = MAX_RECORD_BYTES) -> Any:
    """``store.get(key)`` capped at ``limit`` bytes, parsed with :func:`loads`. NotFoundError
    passes through (absence means something to callers); an oversized object or a special file
    is a CheckpointError."""
    from storage_backends import NotFoundError, StorageError

    try:
        data = store.get(key, limit=limit)
    except NotFoundError:
        raise
    except StorageError as e:
        raise CheckpointError(f"{where}: cannot read {what} ({e})") from None
    return loads(data, where, what)


def is_count(x: Any, least: int = 0, most: int | None = None) -> bool:
    return type(x) is int and x >= least and (most is None or x <= most)


def group_metadata(attributes: dict | None = None) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}).encode()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _tensors_json(entries: tuple[TensorEntry, ...]) -> str:
    """The manifest's tensor list. Saves repeat entries unchanged, so each is serialized once;
    inline scalars change value from save to save and are not cached (the cache stays bounded
    by the state's structure)."""
    return "[" + ",".join(_entry_json(t) if t.value is None else _dumps_entry(t) for t in entries) + "]"


def _dumps_entry(entry: TensorEntry) -> str:
    return json.dumps(entry.to_json(), separators=(",", ":"))


_entry_json = functools.lru_cache(maxsize=1 << 16)(_dumps_entry)


def group_nodes(keys, step: int) -> list[tuple[str, bytes]]:
    """zarr.json of the checkpoint folder and of every intermediate group, so zarr tools can walk
    the hierarchy from the folder down to each array. Keys in the folder, with their bytes."""
    root = ("zarr.json", group_metadata({"ckptd": {"step": step, "format_version": FORMAT_VERSION}}))
    return [root, *_inner_groups(tuple(keys))]


@functools.lru_cache(maxsize=4)
def _inner_groups(keys: tuple[str, ...]) -> tuple[tuple[str, bytes], ...]:
    groups = set()
    for key in keys:
        parts = array_path(key).split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    meta = group_metadata()
    return tuple((f"{g}/zarr.json", meta) for g in sorted(groups))
