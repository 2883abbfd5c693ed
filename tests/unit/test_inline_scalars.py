"""0-d tensors (an optimizer's step counts) are saved without a chunk object: their value is the
``fill_value`` of their zarr.json and sits in the manifest. ckptd, zarr-python and tensorstore
all read the same value; NaN (whose bits JSON would not keep) keeps a chunk object."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ckptd import catalog
from ckptd.manifest import step_dir
from ckptd.verify import verify
from storage_backends import open_store
from trainer_hooks import Checkpointer

SCALARS = {
    "f32": torch.tensor(3.25),
    "f64": torch.tensor(1 / 3, dtype=torch.float64),
    "bf16": torch.tensor(-7.5, dtype=torch.bfloat16),
    "i64": torch.tensor(2**62 + 1),
    "u8": torch.tensor(200, dtype=torch.uint8),
    "flag": torch.tensor(True),
    "inf": torch.tensor(-math.inf),
    "nan": torch.tensor(math.nan),
}


def objects(store, key):
    prefix = f"{step_dir(1)}/arrays/scalars/{key}/"
    return sorted(o.key[len(prefix) :] for o in store.list(prefix))


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, {"scalars": {k: v.clone() for k, v in SCALARS.items()}}).result()
    return root


def test_scalars_are_one_object_and_restore_bitwise(saved):
    store = open_store(saved)
    m = catalog.load_manifest(store)
    for k in SCALARS:
        want = ["c", "zarr.json"] if k == "nan" else ["zarr.json"]
        assert objects(store, k) == want, k
    assert m.tensors["scalars/i64"].value == 2**62 + 1 and m.tensors["scalars/inf"].value == "-Infinity"
    assert verify(store, 1).ok
    live = {"scalars": {k: torch.zeros_like(v) for k, v in SCALARS.items()}}
    with Checkpointer(saved) as ck:
        assert ck.restore(live) == 1
    for k, v in SCALARS.items():
        got = live["scalars"][k]
        assert got.dtype == v.dtype and (torch.equal(got, v) or (k == "nan" and got.isnan().item())), k


@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
def test_zarr_readers_see_the_value(saved, reader):
    for k, v in SCALARS.items():
        path = f"{saved}/{step_dir(1)}/arrays/scalars/{k}"
        if reader == "zarr":
            if k == "bf16":
                continue  # zarr-python 3.1 has no bfloat16
            got = np.asarray(pytest.importorskip("zarr").open_array(path, mode="r")[...])
        else:
            ts = pytest.importorskip("tensorstore")
            got = np.asarray(
                ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()
            )
        want = v.float().numpy() if k == "bf16" else v.numpy()
        if k == "bf16":
            got = got.astype(np.float32) if got.dtype == ml_dtypes.bfloat16 else got
        np.testing.assert_array_equal(got, want, err_msg=k)


def test_verify_reports_a_fill_value_that_disagrees(saved):
    store = open_store(saved)
    key = f"{step_dir(1)}/arrays/scalars/f32/zarr.json"
    meta = json.loads(store.get(key))
    meta["fill_value"] = 4.0
    store.put(key, json.dumps(meta).encode())
    report = verify(store, 1)
    assert not report.ok and "scalars/f32" in report.errors[0] and "fill_value" in report.errors[0]
