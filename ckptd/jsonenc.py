"""JSON with a small typed encoding for what JSON lacks, so no checkpoint ever holds a pickle.

Plain JSON values pass through. The rest becomes a one-key object ``{"$type": payload}``:

=============  ==================================================  =========================
Python         encoded as                                          note
=============  ==================================================  =========================
tuple          ``{"$tuple": [...]}``
bytes          ``{"$bytes": "<base64>"}``
nan/inf        ``{"$float": "nan" | "inf" | "-inf"}``
numpy scalar   ``{"$np": ["int64", 3]}``
numpy array    ``{"$ndarray": ["uint32", [624], "<base64>"]}``      small arrays only (RNG)
dict, non-str  ``{"$dict": [[key, value], ...]}``                  e.g. int optimizer ids
tensor         ``{"$tensor": "model/fc.weight"}``                  the key of a zarr array
torch.dtype    ``{"$dtype": "float32"}``
torch.Size     ``{"$tuple": [...]}``
=============  ==================================================  =========================

A dict whose only key starts with ``$`` would be ambiguous; such user dicts are wrapped in
``$dict`` too. Decoding never imports or calls anything named by the data.
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptd.errors import CheckpointError

__all__ = ["decode", "encode", "tensor_refs"]

_SMALL_ARRAY = 1 << 20  # numpy arrays inline up to 1 MiB (RNG states are ~2.5 KiB)


def encode(obj: Any, on_tensor: Callable[[tuple[str, ...], Any], str] | None = None, path=()) -> Any:
    """Encode ``obj`` to JSON-able data. ``on_tensor(path, tensor)`` is called for each
    torch.Tensor met and returns the array key that stands for it."""
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)).startswith("$")):
            return {k: encode(v, on_tensor, (*path, k)) for k, v in obj.items()}
        return {"$dict": [[encode(k, None, path), encode(v, on_tensor, (*path, str(k)))] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [encode(v, on_tensor, (*path, str(i))) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):  # torch.Size is a tuple
        return {"$tuple": [encode(v, on_tensor, (*path, str(i))) for i, v in enumerate(obj)]}
    if isinstance(obj, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, np.generic):
        return {"$np": [obj.dtype.name, encode(obj.item(), None, path)]}
    if isinstance(obj, np.ndarray):
        if obj.nbytes > _SMALL_ARRAY or obj.dtype.kind not in "biuf":
            raise CheckpointError(f"key {'/'.join(path)!r}: numpy array too large or of unsupported dtype")
        data = base64.b64encode(np.ascontiguousarray(obj).astype(obj.dtype.newbyteorder("<")).tobytes())
        return {"$ndarray": [obj.dtype.name, list(obj.shape), data.decode()]}
    torch = sys.modules.get("torch")  # a tensor or torch.dtype implies torch is imported
    if torch is not None:
        if isinstance(obj, torch.Tensor):
            if on_tensor is None:
                raise CheckpointError(f"key {'/'.join(path)!r}: tensor where only JSON is allowed")
            return {"$tensor": on_tensor(path, obj)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
    raise CheckpointError(
        f"key {'/'.join(path) or '<root>'!r}: cannot store a value of type {type(obj).__name__} "
        "(checkpoints hold tensors and JSON-serialisable values, never pickles)"
    )


def decode(data: Any, on_tensor: Callable[[str], Any] | None = None) -> Any:
    """Inverse of :func:`encode`. ``on_tensor(key)`` returns the tensor for a ``$tensor`` ref.
    Data read from a checkpoint may be hostile: anything malformed (a tag with a value of the
    wrong shape, bad base64, an unknown numpy type, an array larger than encode writes) is a
    CheckpointError, never another exception."""
    try:
        return _decode(data, on_tensor)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"malformed typed JSON value ({type(e).__name__}: {e})") from None


def _decode(data: Any, on_tensor: Callable[[str], Any] | None = None) -> Any:
    if isinstance(data, list):
        return [_decode(v, on_tensor) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, val),) = data.items()
        if tag == "$tuple":
            return tuple(_decode(v, on_tensor) for v in val)
        if tag == "$dict":
            return {_hashable(_decode(k, on_tensor)): _decode(v, on_tensor) for k, v in val}
        if tag == "$float":
            return float(val)
        if tag == "$bytes":
            return base64.b64decode(val, validate=True)
        if tag == "$np":
            if np.dtype(val[0]).kind in "OV":  # objects and raw voids: never from encode
                raise CheckpointError(f"unsupported numpy scalar type {val[0]!r}")
            return np.dtype(val[0]).type(val[1])
        if tag == "$ndarray":
            dtype, shape, b64 = val
            if len(b64) > _SMALL_ARRAY * 4 // 3 + 4 or np.dtype(dtype).kind not in "biuf":
                raise CheckpointError("$ndarray larger than encode writes, or of an unsupported dtype")
            return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).copy()
        if tag == "$tensor":
            if on_tensor is None:
                raise CheckpointError(f"unexpected tensor reference {val!r}")
            return on_tensor(val)
        if tag == "$dtype":
            import torch

            dt = getattr(torch, val, None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointError(f"unknown dtype {val!r}")
            return dt
    return {k: _decode(v, on_tensor) for k, v in data.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def tensor_refs(data: Any) -> list[str]:
    """Every array key referenced from an encoded tree."""
    out, todo = [], [data]
    while todo:  # depth first, in order, with no recursion
        x = todo.pop()
        if isinstance(x, dict) and len(x) == 1 and "$tensor" in x:
            out.append(x["$tensor"])
        elif isinstance(x, list | dict):
            todo.extend(reversed(x if isinstance(x, list) else list(x.values())))
    return out
