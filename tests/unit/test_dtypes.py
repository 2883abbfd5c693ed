"""The one dtype table (``ckptd.dtypes``): its rows, that the numpy and torch sides agree, and
that every row round-trips through a real save and restore (the unsigned types wider than 8
bits were refused by the trainer side's old table while the format's table listed them)."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from ckptd.dtypes import NUMPY, as_numpy, numpy_dtype, torch_dtype, zarr_dtype, zarr_name
from ckptd.errors import CheckpointError
from trainer_hooks import Checkpointer

TABLE = {
    "bool": np.bool_,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "float4_e2m1fn_x2": np.uint8,  # stored as its bytes (``STORED_AS``)
}


def test_the_table_is_pinned():
    assert {k: v.type for k, v in NUMPY.items()} == TABLE


@pytest.mark.parametrize("name", list(TABLE))
def test_numpy_and_torch_sides_agree(name):
    t = torch_dtype(name)
    assert zarr_dtype(t) == name
    assert zarr_name(numpy_dtype(name)) == ("uint8" if name == "float4_e2m1fn_x2" else name)
    assert t.itemsize == numpy_dtype(name).itemsize
    x = torch.zeros(3, dtype=t)
    assert as_numpy(x).dtype == numpy_dtype(name)


def test_outside_the_table_is_one_clear_error():
    with pytest.raises(CheckpointError, match="'w': tensors of dtype torch.complex32 cannot be stored") as e:
        zarr_dtype(torch.complex32, "w")
    # the message lists what is supported and how to store the tensor anyway
    assert "float8_e4m3fn" in str(e.value) and "t.view(torch.uint8)" in str(e.value)
    for bad in ("float8", "", None):
        with pytest.raises(CheckpointError, match="unsupported zarr data type"):
            numpy_dtype(bad)
        with pytest.raises(CheckpointError, match="unsupported zarr data type"):
            torch_dtype(bad)
    with pytest.raises(CheckpointError, match="unsupported dtype >f4"):
        zarr_name(np.dtype(">f4"))


def test_the_format_side_imports_no_torch():
    code = "import sys, ckptd.dtypes, ckptd.codec, ckptd.manifest; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_row_round_trips_through_a_save(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {}
    for name in TABLE:
        t = torch_dtype(name)
        if t == torch.bool:
            state[name] = torch.rand(6, 5, generator=g) > 0.5
        elif t.itemsize == 1 and name.startswith("float"):  # every bit pattern, NaNs included
            state[name] = torch.randint(0, 256, (6, 5), generator=g, dtype=torch.uint8).view(t)
        elif t.is_complex:
            state[name] = torch.randn(6, 5, generator=g, dtype=t)
        else:
            state[name] = (torch.rand(6, 5, generator=g) * 100).to(t)
    state["uint16_image"] = torch.arange(600 * 1000).to(torch.uint16).reshape(600, 1000)  # >= 1 MiB: an image
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"s": state}).result()
    got = {"s": {k: torch.zeros_like(v) for k, v in state.items()}}
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.restore(got) == 1
    for k, v in state.items():
        assert got["s"][k].dtype == v.dtype and torch.equal(got["s"][k].view(torch.uint8), v.view(torch.uint8)), k
