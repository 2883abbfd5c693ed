"""Data types: the one table of what a checkpoint can store, by zarr v3 name.

Each row names a zarr v3 ``data_type``, the numpy dtype its chunks decode to and the torch dtype
a tensor of it has. ``bfloat16`` is the zarr v3 extension name that tensorstore reads; numpy
knows it through ``ml_dtypes``. The unsigned types wider than 8 bits need torch >= 2.3 (the
project needs 2.6).

This module imports no torch: the torch side of the table is looked up from names, so format
code stays torch-free, and only a caller that already holds tensors makes torch load
(``torch_dtype``, ``as_numpy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from ckptd.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["NUMPY", "as_numpy", "numpy_dtype", "torch_dtype", "zarr_dtype", "zarr_name"]

# zarr v3 data_type -> numpy dtype. The torch dtype of each is ``torch.<zarr name>``.
NUMPY: Mapping[str, np.dtype] = MappingProxyType(
    {
        "bool": np.dtype(np.bool_),
        "int8": np.dtype(np.int8),
        "int16": np.dtype(np.int16),
        "int32": np.dtype(np.int32),
        "int64": np.dtype(np.int64),
        "uint8": np.dtype(np.uint8),
        "uint16": np.dtype(np.uint16),
        "uint32": np.dtype(np.uint32),
        "uint64": np.dtype(np.uint64),
        "float16": np.dtype(np.float16),
        "bfloat16": np.dtype(ml_dtypes.bfloat16),
        "float32": np.dtype(np.float32),
        "float64": np.dtype(np.float64),
        "complex64": np.dtype(np.complex64),
        "complex128": np.dtype(np.complex128),
    }
)
_BY_NUMPY = {dt: name for name, dt in NUMPY.items()}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of zarr data type ``name``; CheckpointError if this format has none."""
    try:
        return NUMPY[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unsupported zarr data type {name!r}") from None


def zarr_name(dtype: np.dtype) -> str:
    """The zarr data type of a numpy dtype; CheckpointError if this format has none."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise CheckpointError(f"unsupported dtype {dtype}") from None


def zarr_dtype(dtype: torch.dtype, key: str = "") -> str:
    """The zarr data type of a torch dtype (``key`` names the tensor in the error)."""
    name = str(dtype).removeprefix("torch.")
    if name not in NUMPY:
        raise CheckpointError(f"key {key!r}: tensors of dtype {dtype} cannot be stored")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of zarr data type ``name``."""
    import torch

    numpy_dtype(name)  # the same error for a name outside the table
    return getattr(torch, name)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor (bfloat16 through ml_dtypes)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
