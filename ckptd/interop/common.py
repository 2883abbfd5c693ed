"""What every importer and exporter shares: the state tree with stand-in tensors, the streaming
write into a committed checkpoint, reading a committed checkpoint back one tensor at a time, and
handing pages of memory-mapped source files back to the kernel.

Import: the format module reads the source's *metadata* only and builds an :class:`ImportTree`
of stand-in tensors; :func:`write_import` encodes it the way ``trainer_hooks.flatten`` encodes a
live state (so ``Checkpointer.restore`` finds every key), then pulls ``(item, tensor)`` pairs
from the format's loader one at a time into a :class:`ckptd.stream.CheckpointWriter`, which
commits after the last one.

Export reads the manifest, decodes each top-level entry with ``meta`` stand-ins for its tensors
(:class:`SavedCheckpoint`), and the format module asks for each tensor's data only when it writes
that tensor. Memory stays near the largest tensor (plus bounded write-behind, and
:func:`release_file_pages` for mapped sources).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd import catalog, jsonenc, pins
from ckptd import manifest as mf
from ckptd.dtypes import as_numpy, torch_dtype, zarr_dtype
from ckptd.errors import CheckpointError
from ckptd.layout import Box
from ckptd.reader import CheckpointReader, ReadRequest
from ckptd.stream import CheckpointWriter
from storage_backends import Store

__all__ = [
    "ExportResult",
    "ImportResult",
    "ImportTree",
    "Item",
    "Loader",
    "MAX_TENSORS",
    "Progress",
    "SavedCheckpoint",
    "TRIM_BYTES",
    "WRITE_BEHIND_BYTES",
    "check_count",
    "check_output",
    "flat_tensors",
    "one_line",
    "release_file_pages",
    "staged_output",
    "trim_heap",
    "write_import",
]

# Encoded shards waiting for their put. The stream writer's default (512 MiB) favours throughput;
# an import is bounded by its source's read speed, so a smaller write-behind costs little.
WRITE_BEHIND_BYTES = 32 * 1024 * 1024

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)

# An import's cost grows with its tensor count, not only its bytes: each tensor is an array (its
# zarr.json, a manifest row, at least one put). A source's metadata is a few dozen bytes per
# tensor, so a 20 MB safetensors header described 300,000 empty tensors and kept ``ckptd
# import`` busy for over 20 minutes. The largest published models have under 100,000 tensors
# (DeepSeek-V3: about 92,000); ``ckptd import --max-tensors`` raises the bound.
MAX_TENSORS = 250_000
# Heap trims and page releases run once per this many bytes of tensors, not once per tensor:
# each walks the whole heap or the process's mappings.
TRIM_BYTES = 16 * 1024 * 1024


def check_count(n: int, max_tensors: int, where: str) -> None:
    """CheckpointError when a source holds more than ``max_tensors`` tensors."""
    if n > max_tensors:
        raise CheckpointError(
            f"{where}: {n} tensors, more than the {max_tensors} an import accepts (--max-tensors to allow more)"
        )


def _no_progress(done: int, total: int) -> None:
    pass


def one_line(e: BaseException) -> str:
    """An exception's text as one short line for a CLI error (torch's unpickler advice cut)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # skip torch's advice, keep the reason
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
    text = " ".join(text.split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


@dataclass(frozen=True)
class Item:
    """One tensor to import: its ckptd array key, what the format's loader needs to fetch it
    (a DCP key, a file and name, a lazily mapped tensor), and its global shape and dtype."""

    key: str
    source: Any
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Loader = Callable[[list[Item]], Iterator[tuple[Item, torch.Tensor]]]


@dataclass
class ImportTree:
    """Top-level state entries found in a source: ``name -> (kind, tree)``. Tensors in a tree are
    either :meth:`placeholder` stand-ins (their source recorded here) or real tensors that are
    their own source (a ``torch.load(mmap=True)`` file)."""

    entries: dict[str, tuple[str, Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # recorded in the manifest's layout
    _sources: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)

    def placeholder(self, source: Any, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        self._sources[id(t)] = (t, source)  # the tensor is kept alive, so its id stays unique
        return t

    def add(self, name: str, kind: str, tree: Any) -> None:
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"top-level state keys must be non-empty strings, got {name!r}")
        if name in self.entries:
            raise CheckpointError(f"key {name!r} appears twice at the top level")
        self.entries[name] = (kind, tree)

    def encode(self) -> tuple[dict[str, dict], list[Item]]:
        """The manifest's state tree and the tensors to write, in tree order. Array keys are the
        ones ``trainer_hooks.flatten`` gives a live state of the same shape: one path component
        per dict key (an FQN is one component), list indices as components."""
        items: list[Item] = []
        seen: set[str] = set()

        def on_tensor(path: tuple[str, ...], t: torch.Tensor) -> str:
            key = mf.key_of(path)
            if key in seen:
                raise CheckpointError(f"key {key!r} appears twice in the imported state")
            seen.add(key)
            zarr_dtype(t.dtype, key)  # an unsupported dtype fails before any data is written
            _, source = self._sources.get(id(t), (None, t))
            items.append(Item(key, source, tuple(t.shape), t.dtype))
            return key

        state = {
            name: {"kind": kind, "data": jsonenc.encode(tree, on_tensor, (name,))}
            for name, (kind, tree) in self.entries.items()
        }
        return state, items


@dataclass(frozen=True)
class ImportResult:
    step: int
    where: str
    tensors: int
    bytes: int
    kinds: dict[str, str]
    notes: list[str] = field(default_factory=list)  # what was left out, for the user


def write_import(
    store: Store,
    step: int,
    tree: ImportTree,
    load: Loader,
    progress: Progress = _no_progress,
    max_tensors: int = MAX_TENSORS,
) -> ImportResult:
    """Write ``tree`` as committed checkpoint ``step``, fetching tensors through ``load``.
    More than ``max_tensors`` tensors is refused before anything is written.

    The step must not be committed yet (checked before any data is read). A failure leaves a
    partial folder that nothing restores and the next attempt replaces."""
    state, items = tree.encode()
    check_count(len(items), max_tensors, tree.info.get("path", "source"))
    total_bytes = sum(it.nbytes for it in items)
    since_trim = 0
    with CheckpointWriter(
        store, step, layout_info={"imported_from": tree.info}, max_pending_bytes=WRITE_BEHIND_BYTES
    ) as w:
        done = 0
        progress(0, len(items))
        for done, (it, t) in enumerate(load(items), 1):
            if tuple(t.shape) != it.shape or t.dtype != it.dtype:
                raise CheckpointError(
                    f"{tree.info.get('path', 'source')}: tensor {it.source!r} is {t.dtype} {tuple(t.shape)} "
                    f"but its metadata says {it.dtype} {it.shape}"
                )
            w.write_tensor(it.key, t)
            del t
            since_trim += it.nbytes
            if since_trim >= TRIM_BYTES:  # not per tensor: malloc_trim walks the whole heap
                trim_heap()
                since_trim = 0
            progress(done, len(items))
        if done != len(items):
            raise CheckpointError(f"internal error: {len(items) - done} tensors were not loaded")
        w.set_state(state)
    kinds = {n: k for n, (k, _) in tree.entries.items()}
    return ImportResult(step, catalog.where(store, step), len(items), total_bytes, kinds, tree.info.get("notes", []))


@dataclass(frozen=True)
class ExportResult:
    files: list[str]
    tensors: int
    skipped: int = 0  # non-tensor values the format cannot hold, left out


class SavedCheckpoint:
    """A committed checkpoint opened for export: its state entries decoded with ``meta``
    stand-ins for tensors, and :meth:`read` for one tensor's data at a time."""

    def __init__(self, store: Store, step: int | None, threads: int = 8):
        self.store = store
        self.manifest = catalog.load_manifest(store, step)
        self.step = self.manifest.step
        self.where = catalog.where(store, self.step)
        self.reader = CheckpointReader(store, mf.step_dir(self.step), pins=pins.committed(store, self.step))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptd-export")
        self._keys: dict[int, tuple[torch.Tensor, str]] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SavedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return list(self.manifest.state)

    def decode(self, name: str) -> tuple[str, Any]:
        """``(kind, tree)`` of one top-level entry; tensors are ``meta`` stand-ins."""
        node = self.manifest.state[name]

        def on_tensor(key: str) -> torch.Tensor:
            entry = self.manifest.tensors.get(key)
            if entry is None:
                raise CheckpointError(f"{self.where}: state refers to array {key!r}, which the manifest lacks")
            t = torch.empty(entry.layout.shape, dtype=torch_dtype(entry.layout.dtype), device="meta")
            self._keys[id(t)] = (t, key)
            return t

        return node["kind"], jsonenc.decode(node["data"], on_tensor)

    def key_of(self, placeholder: torch.Tensor) -> str:
        return self._keys[id(placeholder)][1]

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a fresh CPU tensor (every chunk's crc32c checked)."""
        entry = self.manifest.tensors[key]
        out = torch.empty(entry.layout.shape, dtype=torch_dtype(entry.layout.dtype))
        if out.numel():
            self.reader.read([ReadRequest(entry, Box.full(entry.layout.shape), as_numpy(out))], self._pool)
        return out


def flat_tensors(saved: SavedCheckpoint, name: str) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of entry ``name`` as one flat state dict of stand-ins: an FQN-keyed module or
    dict keeps its FQNs; deeper paths are joined with ``.`` (``state.fc.weight.exp_avg``), the way
    ``torch.distributed.checkpoint`` names them. Also returns how many non-tensor values were
    left out."""
    if name not in saved.manifest.state:
        have = ", ".join(repr(n) for n in saved.names) or "none"
        raise CheckpointError(f"{saved.where}: no state entry {name!r} (entries: {have}); choose one with --as")
    _, tree = saved.decode(name)
    out: dict[str, torch.Tensor] = {}
    skipped = 0

    def walk(prefix: str, x: Any) -> None:
        nonlocal skipped
        if isinstance(x, torch.Tensor):
            flat = prefix or name  # a bare tensor entry keeps the entry's name
            if flat in out:
                raise CheckpointError(f"{saved.where}: two tensors of {name!r} flatten to the name {flat!r}")
            out[flat] = x
        elif isinstance(x, dict | list | tuple):
            for k, v in x.items() if isinstance(x, dict) else enumerate(x):
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            skipped += 1

    walk("", tree)
    return out, skipped


def check_output(out: str) -> None:
    """Exports never overwrite: OUT must not exist, or be an empty folder."""
    if os.path.isdir(out):
        if os.listdir(out):
            raise CheckpointError(f"{out}: folder exists and is not empty; remove it or choose another OUT")
    elif os.path.lexists(out):
        raise CheckpointError(f"{out}: exists; remove it or choose another OUT")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{out}: parent folder {parent} does not exist")


@contextlib.contextmanager
def staged_output(out: str) -> Iterator[str]:
    """Yield a path beside ``out`` to write an export to, so that ``out`` never holds a
    half-written export; rename it to ``out`` when the block ends normally, remove it when the
    block (or the rename) raises. The caller checks ``out`` with :func:`check_output` first."""
    head, tail = os.path.split(os.path.abspath(out))
    tmp = os.path.join(head, f".{tail}.partial-{os.getpid()}")
    try:
        yield tmp
        if os.path.isdir(out):  # the empty folder check_output allowed
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        raise


@functools.cache
def _c():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def trim_heap() -> None:
    """Give freed heap memory back to the kernel (glibc; a no-op elsewhere).

    Tensors of a few MiB are allocated and freed one after another here. glibc raises its mmap
    threshold after such frees (up to 32 MiB), so later ones come from the heap, where freed
    blocks stay resident and fragmentation lets the heap grow far past one tensor. Trimming after
    each tensor keeps RSS near the live data."""
    if not sys.platform.startswith("linux"):
        return
    trim = getattr(_c(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def release_file_pages(path: str) -> None:
    """Drop this process's resident pages of every memory mapping of ``path`` (Linux; a no-op
    elsewhere).

    ``torch.load(mmap=True)`` and ``safetensors.safe_open`` map the whole file; each page a
    tensor touches stays resident, and counted in RSS, until the mapping goes. The pages are
    clean (nothing writes to them) or, for a ``MAP_SHARED`` output mapping, already in the page
    cache, so ``MADV_DONTNEED`` loses nothing: a later touch faults the same bytes back in from
    the file."""
    if not sys.platform.startswith("linux"):
        return
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            maps = [line.split(maxsplit=5) for line in f]
    except OSError:
        return
    for parts in maps:
        if len(parts) == 6 and parts[5].rstrip("\n") == real:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            _c().madvise(lo, hi - lo, mmap.MADV_DONTNEED)  # best effort: memory, not correctness
