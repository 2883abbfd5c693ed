"""Data types: the one table of what a checkpoint can store, by zarr v3 name.

Each row names a zarr v3 ``data_type``, the numpy dtype its chunks decode to and the torch dtype
a tensor of it has. ``bfloat16`` is the zarr v3 extension name that tensorstore reads; numpy
knows it through ``ml_dtypes``. The unsigned types wider than 8 bits need torch >= 2.3 (the
project needs 2.6).

The float8 types are stored under their own zarr v3 names (the names torch, ml_dtypes and
tensorstore share): tensorstore (0.1.86, tested) reads and writes every one of them, each byte as it
is, and numpy sees them as ``ml_dtypes`` types. zarr-python (3.1) has no float8 data type.
A torch too old to have one of these types gets a ``CheckpointError`` from ``torch_dtype``.

``float4_e2m1fn_x2`` (two FP4 values packed in one byte) has
no zarr v3 data type with the same element: tensorstore's ``float4_e2m1fn`` is one value per
element. It is stored as ``uint8`` (one element per byte, the tensor's shape, the bytes
unchanged) and its ``zarr.json`` names the torch dtype in the attribute
``"ckptd_dtype": "float4_e2m1fn_x2"`` (``STORED_AS``, ``DTYPE_ATTRIBUTE``): readers without
ckptd see the packed bytes, ckptd (manifest, restore, ``ckptd show``) the torch dtype.

This module imports no torch: the torch side of the table is looked up from names, so format
code stays torch-free, and only a caller that already holds tensors makes torch load
(``torch_dtype``, ``as_numpy``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from ckptd.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_ATTRIBUTE",
    "NUMPY",
    "STORED_AS",
    "as_numpy",
    "itemsize",
    "numpy_dtype",
    "stored_name",
    "torch_dtype",
    "zarr_dtype",
    "zarr_name",
]

# ckptd dtype name -> numpy dtype; for the rows numpy knows through ``ml_dtypes`` (the type of the
# same name there), their itemsize instead: its extension takes about a second to import, so it
# loads at the first look-up of such a row (a checkpoint that holds one, as numpy), never for the
# names alone.
_ROWS: dict[str, np.dtype | int] = {
    **{
        n: np.dtype(n)
        for n in ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16"]
    },
    "bfloat16": 2,
    **{n: np.dtype(n) for n in ("float32", "float64", "complex64", "complex128")},
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"), 1),
    "float4_e2m1fn_x2": np.dtype(np.uint8),
}


class _Table(Mapping):
    """``NUMPY``, read-only: membership, iteration and ``itemsize`` import no ``ml_dtypes``."""

    def __getitem__(self, name: str) -> np.dtype:
        row = _ROWS[name]
        if isinstance(row, int):
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, name))
        return row

    def __contains__(self, name) -> bool:
        return name in _ROWS

    def __iter__(self) -> Iterator[str]:
        return iter(_ROWS)

    def __len__(self) -> int:
        return len(_ROWS)


# ckptd dtype name -> numpy dtype. The torch dtype of each is ``torch.<name>``; the zarr v3
# ``data_type`` is the name itself except where ``STORED_AS`` says otherwise.
NUMPY: Mapping[str, np.dtype] = _Table()
# The names whose zarr v3 ``data_type`` differs: the zarr.json names the ckptd dtype in the
# attribute ``DTYPE_ATTRIBUTE``.
STORED_AS: Mapping[str, str] = MappingProxyType({"float4_e2m1fn_x2": "uint8"})
DTYPE_ATTRIBUTE = "ckptd_dtype"

_WORKAROUND = (
    "supported dtypes: {names}. Store another dtype as its bits (t.view(torch.uint8), or the "
    "integer type of its width) or converted (t.to(torch.float32)), and convert back after restore"
)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of zarr data type ``name``; CheckpointError if this format has none."""
    try:
        return NUMPY[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unsupported zarr data type {name!r}") from None


def itemsize(name: str) -> int:
    """The bytes per element of ckptd dtype ``name`` (without importing ``ml_dtypes``)."""
    try:
        row = _ROWS[name]
    except (KeyError, TypeError):
        numpy_dtype(name)  # raises the one error for a name outside the table
        raise
    return row if isinstance(row, int) else row.itemsize


def zarr_name(dtype: np.dtype) -> str:
    """The zarr data type of a numpy dtype; CheckpointError if this format has none."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"unsupported dtype {dtype}") from None
    # an ml_dtypes type is named as its row; another byte order, or a row stored as another
    # (float4_e2m1fn_x2 as uint8), is not that row
    if dt.name not in NUMPY or dt.name in STORED_AS or NUMPY[dt.name] != dt:
        raise CheckpointError(f"unsupported dtype {dtype}")
    return dt.name


def stored_name(name: str) -> str:
    """The zarr v3 ``data_type`` that ckptd dtype ``name`` is written as."""
    return STORED_AS.get(name, name)


def zarr_dtype(dtype: torch.dtype, key: str = "") -> str:
    """The ckptd dtype name of a torch dtype (``key`` names the tensor in the error)."""
    name = str(dtype).removeprefix("torch.")
    if name not in NUMPY:
        raise CheckpointError(
            f"key {key!r}: tensors of dtype {dtype} cannot be stored; " + _WORKAROUND.format(names=", ".join(NUMPY))
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ckptd dtype ``name``."""
    import torch

    numpy_dtype(name)  # the same error for a name outside the table
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name!r} needs a newer torch than {torch.__version__}")
    return dt


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor (bfloat16 and float8 through ml_dtypes,
    float4_e2m1fn_x2 as its bytes): torch's ``numpy()`` knows none of them, so they go through
    the integer type of their width."""
    name = str(t.dtype).removeprefix("torch.")
    if name == "bfloat16" or name in _VIA_BYTES:
        import torch

        width = torch.int16 if name == "bfloat16" else torch.uint8
        return t.view(width).numpy().view(NUMPY[name])
    return t.numpy()


_VIA_BYTES = frozenset(n for n in NUMPY if n.startswith(("float8", "float4")))
