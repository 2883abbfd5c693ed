"""Run as ``python tests/ops/read_without_torch.py URI REF_DIR``: opens a committed checkpoint with
``ckptd.open_array`` and ``ckptd.open_group`` and compares with the ``.npy`` references in
REF_DIR (bfloat16 as its uint16 bits), then checks that torch was never imported. Prints one
JSON line; exits non-zero on any mismatch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import ckptd


def main(uri: str, refs: str) -> dict:
    checked = []
    for f in sorted(Path(refs).glob("*.npy")):
        key = f.stem.replace("__", "/")
        want = np.load(f)
        arr = ckptd.open_array(uri, key)
        got = arr.read().result()
        if key.endswith("bf16"):
            assert got.dtype == ml_dtypes.bfloat16, got.dtype
            got = got.view(np.uint16)
        assert got.shape == want.shape and np.array_equal(got, want), key
        # a slice reads only its rows, and matches the same rows of the whole
        assert np.array_equal(np.asarray(arr[1:3].read().result()).view(want.dtype), want[1:3]), key
        checked.append(key)
    group = ckptd.open_group(uri)
    w = np.load(Path(refs) / "model__fc1.weight.npy")
    zarr_w = group["arrays/model/fc1.weight"]
    assert np.array_equal(zarr_w[:], w) and np.array_equal(zarr_w[2:5, :4], w[2:5, :4])
    assert group.attrs["ckptd"]["step"] == 1
    assert "torch" not in sys.modules, "torch was imported"
    return {"checked": checked, "torch_imported": "torch" in sys.modules}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
