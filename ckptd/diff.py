"""Compare two committed checkpoints value by value, whatever their layouts.

Two steps of one job root, or two roots (a checkpoint and its ``--rechunk`` copy, an import and
its source, a 4-rank save and a 3-rank save of the same state). Each tensor present on both
sides with the same shape and dtype is read in blocks of whole rows of its global array through
``CheckpointReader`` (every chunk's crc32c checked), both sides into the same two preallocated
buffers, so memory stays at two blocks (``block_bytes`` each) whatever the checkpoint's size and
however either side was sharded.

"Equal" means bitwise equal (did a reshard, import or export preserve every value?): -0.0 against
0.0, or two NaNs with different payloads, differ, with a max abs diff of 0 (or NaN). For floating
types ``max_ulps`` is the largest distance in representable values between differing values of
one sign; across zero it would count every float between them (about 2e9 for two tiny float32
values) and say nothing, so such pairs are counted in ``cross_zero`` and measured by
``max_rel_diff`` (|a - b| / max(|a|, |b|); 2 for x against -x). For integers and bools
``max_abs_diff`` is exact. Non-tensor state (the manifest's JSON tree) is compared by path.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckptd import catalog, pins
from ckptd import manifest as mf
from ckptd.layout import Box
from ckptd.reader import CheckpointReader, ReadRequest
from storage_backends import Store

__all__ = ["BLOCK_BYTES", "DiffReport", "TensorDiff", "diff"]

BLOCK_BYTES = 64 << 20
_INT_OF = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass
class TensorDiff:
    key: str
    status: str  # equal | different | mismatch (shape or dtype) | only_a | only_b
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    different: int = 0  # elements that are not bitwise equal
    max_abs_diff: float | int | None = None
    max_ulps: int | None = None  # over differing pairs of one sign (a zero counts as either)
    max_rel_diff: float | None = None
    cross_zero: int = 0  # differing pairs of nonzero values of opposite signs (not in max_ulps)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("max_abs_diff", "max_rel_diff"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = str(d[k])  # JSON has no nan/inf
        return d


@dataclass
class DiffReport:
    uri_a: str
    step_a: int
    uri_b: str
    step_b: int
    tensors: list[TensorDiff] = field(default_factory=list)
    state: list[dict] = field(default_factory=list)  # {"path", "a", "b"} per differing leaf
    bytes_compared: int = 0

    @property
    def equal(self) -> bool:
        return not self.state and all(t.status == "equal" for t in self.tensors)

    def counts(self) -> dict[str, int]:
        return dict(Counter(t.status for t in self.tensors))

    def to_json(self) -> dict:
        return {
            "equal": self.equal,
            "a": {"uri": self.uri_a, "step": self.step_a},
            "b": {"uri": self.uri_b, "step": self.step_b},
            "counts": self.counts(),
            "tensors": [t.to_json() for t in self.tensors],
            "only_a": [t.key for t in self.tensors if t.status == "only_a"],
            "only_b": [t.key for t in self.tensors if t.status == "only_b"],
            "state": self.state,
            "bytes_compared": self.bytes_compared,
        }


def diff(
    store_a: Store,
    store_b: Store,
    step_a: int | None = None,
    step_b: int | None = None,
    *,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> DiffReport:
    """Compare committed ``step_a`` of ``store_a`` with ``step_b`` of ``store_b`` (each the
    latest committed step when None). ``progress(bytes_done, bytes_total)`` is called as blocks
    are compared. Raises ``CheckpointError`` for a step that is not committed or a corrupt chunk."""
    ma = catalog.load_manifest(store_a, step_a)
    mb = catalog.load_manifest(store_b, step_b)
    report = DiffReport(store_a.uri, ma.step, store_b.uri, mb.step)
    ra, rb = (
        CheckpointReader(s, mf.step_dir(m.step), catalog.where(s, m.step), pins.committed(s, m.step))
        for s, m in ((store_a, ma), (store_b, mb))
    )
    keys = sorted(ma.tensors.keys() | mb.tensors.keys())
    pairs = [(ma.tensors[k], mb.tensors[k]) for k in keys if k in ma.tensors and k in mb.tensors]
    comparable = {a.key for a, b in pairs if a.layout.shape == b.layout.shape and a.layout.dtype == b.layout.dtype}
    total = sum(ma.tensors[k].layout.nbytes for k in comparable)
    done = 0
    buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in keys:
        a, b = ma.tensors.get(key), mb.tensors.get(key)
        status = "only_b" if a is None else "only_a" if b is None else "equal" if key in comparable else "mismatch"
        td = TensorDiff(key, status)
        if a is not None:
            td.shape_a, td.dtype_a = list(a.layout.shape), a.layout.dtype
        if b is not None:
            td.shape_b, td.dtype_b = list(b.layout.shape), b.layout.dtype
        report.tensors.append(td)
        if status != "equal":
            continue
        for box in _blocks(a.layout.shape, a.layout.itemsize, block_bytes):
            if box.volume:
                va, vb = _buffers(buffers, a.layout.np_dtype, box, block_bytes)
                ra.read([ReadRequest(a, box, va)])
                rb.read([ReadRequest(b, box, vb)])
                _compare(td, va, vb)
            done += box.volume * a.layout.itemsize
            if progress is not None:
                progress(done, total)
        if td.different:
            td.status = "different"
    report.bytes_compared = done
    _diff_state(ma.state, mb.state, "", report.state)
    return report


def _blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int):
    """Boxes of whole rows (dim 0) of at most ``block_bytes``; a row over the limit is split on
    the next dimension, and so on."""
    if not shape or math.prod(shape) == 0:
        yield Box.full(shape)
        return
    inner = math.prod(shape[1:]) * itemsize
    if inner <= block_bytes or len(shape) == 1:
        rows = max(1, block_bytes // max(1, inner)) if len(shape) > 1 else max(1, block_bytes // itemsize)
        for r in range(0, shape[0], rows):
            yield Box((r, *(0 for _ in shape[1:])), (min(shape[0], r + rows), *shape[1:]))
        return
    for r in range(shape[0]):
        for sub in _blocks(shape[1:], itemsize, block_bytes):
            yield Box((r, *sub.start), (r + 1, *sub.stop))


def _buffers(cache: dict, dtype: np.dtype, box: Box, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of shape ``box.shape`` over two reusable flat buffers of the block size."""
    n = box.volume
    cur = cache.get(dtype)  # keyed by dtype, not dtype.str: every ml_dtypes float8 type is "|V1"
    if cur is None or cur[0].size < n:
        cache.clear()  # one dtype's pair at a time: memory stays at two blocks
        size = max(n, block_bytes // dtype.itemsize)
        cur = cache[dtype] = (np.empty(size, dtype), np.empty(size, dtype))
    return cur[0][:n].reshape(box.shape), cur[1][:n].reshape(box.shape)


def _compare(td: TensorDiff, a: np.ndarray, b: np.ndarray) -> None:
    """Fold one block's differences into ``td``."""
    itemsize = a.dtype.itemsize
    # ml_dtypes' floats (bfloat16, float8_*) are numpy kind "V": compared by their bits too, so
    # that two NaNs with the same bits are equal
    floating = a.dtype.kind == "f" or a.dtype.name == "bfloat16" or a.dtype.name.startswith("float8")
    if a.dtype.kind == "b":
        ia, ib = a.view(np.uint8), b.view(np.uint8)
    elif floating:
        ia, ib = a.view(_INT_OF[itemsize]), b.view(_INT_OF[itemsize])
    else:
        ia, ib = a, b
    neq = ia != ib
    n = int(np.count_nonzero(neq))
    if td.max_abs_diff is None:
        td.max_abs_diff, td.max_ulps, td.max_rel_diff = (0.0, 0, 0.0) if floating else (0, None, None)
    if not n:
        return
    td.different += n
    wa, wb = ia[neq], ib[neq]
    if floating:
        fa, fb = a[neq].astype(np.float64), b[neq].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(fa - fb)
        d = np.where(np.isnan(fa) & np.isnan(fb), 0.0, d)  # two NaNs: no distance in value, but not bitwise equal
        m = float(np.nanmax(d)) if not np.all(np.isnan(d)) else float("nan")
        td.max_abs_diff = float(np.max([td.max_abs_diff, m]))  # a NaN on either side stays NaN
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            rel = d / np.maximum(np.abs(fa), np.abs(fb))
        rel = rel[~np.isnan(rel)]  # two zeros (signed), or a NaN on a side
        if rel.size:
            td.max_rel_diff = max(td.max_rel_diff or 0.0, float(rel.max()))
        if a.dtype.name == "float8_e8m0fnu":  # no sign bit: the bits are the exponent, in order
            ulps = int(np.abs(wa.view(np.uint8).astype(np.int64) - wb.view(np.uint8).astype(np.int64)).max())
            td.max_ulps = max(td.max_ulps or 0, ulps)
        else:
            cross = ((wa < 0) != (wb < 0)) & (fa != 0) & (fb != 0) & ~np.isnan(fa) & ~np.isnan(fb)
            td.cross_zero += int(np.count_nonzero(cross))
            if not cross.all():
                td.max_ulps = max(td.max_ulps or 0, _max_ulps(wa[~cross], wb[~cross]))
    else:
        if not (a.dtype.kind == "u" and itemsize == 8):
            wa, wb = wa.astype(np.int64), wb.astype(np.int64)
        d = np.where(wa >= wb, wa - wb, wb - wa).view(np.uint64)  # int64 differences wrap: as uint64
        td.max_abs_diff = max(int(td.max_abs_diff), int(d.max()))


def _max_ulps(ia: np.ndarray, ib: np.ndarray) -> int:
    """Largest distance between two float bit patterns counted in representable values:
    the sign-magnitude bits mapped to a monotonic integer line (-0.0 and 0.0 are 1 apart)."""
    lo = np.iinfo(ia.dtype).min
    # 64-bit floats: the integer line needs 65 bits; Python ints (an object array) are exact
    wide = object if ia.dtype == np.int64 else np.int64
    oa, ob = (np.where(x < 0, lo - x.astype(wide) - 1, x.astype(wide)) for x in (ia, ib))
    return int(np.abs(oa - ob).max())


def _diff_state(a: Any, b: Any, path: str, out: list[dict], limit: int = 1000) -> None:
    """Leaves of the two JSON trees that differ (by path), up to ``limit`` of them."""
    if len(out) >= limit or _is_ref(a) or _is_ref(b):
        return  # a tensor's place in the tree: its values are compared (or listed as one-sided) above
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            sub = f"{path}/{k}" if path else k
            if _is_ref(a.get(k)) or _is_ref(b.get(k)):
                continue
            if k not in b:
                out.append({"path": sub, "a": _short(a[k]), "b": "(absent)"})
            elif k not in a:
                out.append({"path": sub, "a": "(absent)", "b": _short(b[k])})
            else:
                _diff_state(a[k], b[k], sub, out, limit)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff_state(x, y, f"{path}/{i}", out, limit)
        return
    if type(a) is not type(b) or a != b:
        out.append({"path": path or "/", "a": _short(a), "b": _short(b)})


def _is_ref(v: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and "$tensor" in v


def _short(v: Any, n: int = 80) -> str:
    s = json.dumps(v, separators=(",", ":"), default=str)
    return s if len(s) <= n else s[: n - 3] + "..."
