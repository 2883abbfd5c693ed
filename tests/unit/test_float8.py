"""float8 and float4 tensors (what FP8 training keeps) are saved and restored bitwise, read by
tensorstore without torch, listed by ``ckptd show`` and exported to safetensors where it has the
type (``ckptd.dtypes``). Every bit pattern of each type is stored, NaNs included.

The distributed case (DTensor shards saved at 2 ranks, restored at 1 and 3) is
``tests/distributed/test_users.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckptd.errors import CheckpointError
from trainer_hooks import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
NAMES = [*FLOAT8, "float4_e2m1fn_x2"]
SAFETENSORS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def bits(name: str, shape=(16, 16), seed: int = 0) -> torch.Tensor:
    """A tensor of dtype ``name`` holding every byte value (a permutation of 0..255, tiled)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    b = torch.cat([torch.randperm(256, generator=g) for _ in range(-(-n // 256))])[:n]
    return b.to(torch.uint8).reshape(shape).view(getattr(torch, name))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_state(seed: int = 0) -> dict:
    tensors = {}
    for i, name in enumerate(NAMES):
        tensors[name] = bits(name, seed=seed + i)
        tensors[f"{name}_0d"] = bits(name, (), seed=seed + 10 + i)  # a scale: one element
        tensors[f"{name}_odd"] = bits(name, (37, 5), seed=seed + 20 + i)
    # >= 1 MiB of whole rows: staged as an object image, written without encoding
    tensors["big_e4m3"] = bits("float8_e4m3fn", (1100, 1024), seed=seed + 30)
    model = torch.nn.Linear(8, 6)
    with torch.no_grad():
        model.weight = torch.nn.Parameter(bits("float8_e4m3fn", (6, 8), seed=seed + 40), requires_grad=False)
        model.bias = torch.nn.Parameter(bits("float8_e5m2", (6,), seed=seed + 41), requires_grad=False)
    return {"fp8": tensors, "model": model}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("fp8") / "job")
    state = fp8_state()
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    return root, state


@pytest.mark.parametrize("in_place", [False, True])
def test_every_float8_dtype_restores_bitwise(saved, in_place):
    root, state = saved
    fresh = fp8_state(seed=100)
    with Checkpointer(root) as ck:
        assert ck.restore(fresh, in_place=in_place) == 1
    for k, v in state["fp8"].items():
        assert same_bits(fresh["fp8"][k], v), k
    for k, v in state["model"].state_dict().items():
        assert same_bits(fresh["model"].state_dict()[k], v), k


def test_the_checkpoint_verifies_and_names_the_dtypes(saved):
    root, _ = saved
    run = _cli("verify", root)
    assert run.returncode == 0, run.stderr
    show = _cli("show", root)
    assert show.returncode == 0, show.stderr
    rows = {
        line.split()[0]: re.split(r"\s{2,}", line)
        for line in show.stdout.splitlines()
        if line.startswith(("fp8/", "model/"))
    }
    for name in NAMES:
        assert rows[f"fp8/{name}"][2] == name
        assert rows[f"fp8/{name}_0d"][2] == name
    assert rows["model/weight"][2] == "float8_e4m3fn"


def test_zarr_json_names_a_data_type_tensorstore_knows(saved):
    root, _ = saved
    step = Path(root, "step_0000000001", "arrays", "fp8")
    for name in FLOAT8:
        assert json.loads((step / name / "zarr.json").read_text())["data_type"] == name
    x2 = json.loads((step / "float4_e2m1fn_x2" / "zarr.json").read_text())
    assert x2["data_type"] == "uint8" and x2["attributes"]["ckptd_dtype"] == "float4_e2m1fn_x2"


READER = """
import json, sys
import ml_dtypes, numpy as np
import ckptd
root, refs = sys.argv[1], json.loads(sys.argv[2])
for key, (dtype, hexbytes, shape) in refs.items():
    arr = ckptd.open_array(root, key)
    got = arr.read().result()
    assert got.dtype == np.dtype(getattr(ml_dtypes, dtype, None) or dtype), (key, got.dtype)
    assert list(got.shape) == shape, key
    assert got.tobytes().hex() == hexbytes, key
    if shape:
        assert arr[1:3].read().result().tobytes() == got[1:3].tobytes(), key  # a slice reads its rows
assert "torch" not in sys.modules
print("ok", len(refs))
"""


def test_open_array_reads_them_without_torch(saved):
    root, state = saved
    refs = {}
    for k, v in state["fp8"].items():
        if k == "big_e4m3":
            continue
        name = str(v.dtype).removeprefix("torch.")
        # tensorstore sees float4_e2m1fn_x2 as the uint8 it is stored as
        refs[f"fp8/{k}"] = ("uint8" if name == "float4_e2m1fn_x2" else name, _hex(v), list(v.shape))
    run = subprocess.run(
        [sys.executable, "-c", READER, root, json.dumps(refs)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["ok", str(len(refs))]


def test_export_to_safetensors_and_read_back(saved, tmp_path):
    root, state = saved
    # the model: float8_e4m3fn and float8_e5m2, both safetensors types
    out = tmp_path / "model.safetensors"
    run = _cli("export", "--format", "safetensors", root, out)
    assert run.returncode == 0, run.stderr
    got = load_file(out)
    for k, v in state["model"].state_dict().items():
        assert same_bits(got[k], v), k


def test_export_to_safetensors_of_each_type(tmp_path):
    for name in SAFETENSORS:
        root = str(tmp_path / name)
        t = bits(name, (9, 4))
        with Checkpointer(root) as ck:
            ck.save(1, {"model": {"w": t}}).result()
        run = _cli("export", "--format", "safetensors", root, tmp_path / f"{name}.safetensors")
        assert run.returncode == 0, run.stderr
        assert same_bits(load_file(tmp_path / f"{name}.safetensors")["w"], t), name


def test_import_of_a_float8_safetensors_file(tmp_path):
    """A safetensors file of F8 tensors (as ``safetensors.torch.save_file`` writes it) imports
    and restores bitwise."""
    from safetensors.torch import save_file

    tensors = {name: bits(name, (7, 3), seed=i).contiguous() for i, name in enumerate(SAFETENSORS)}
    save_file(tensors, tmp_path / "in.safetensors")
    root = str(tmp_path / "job")
    run = _cli("import", "--format", "safetensors", "--step", 1, tmp_path / "in.safetensors", root)
    assert run.returncode == 0, run.stderr
    got = {"model": {k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in tensors.items()}}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 1
    for k, v in tensors.items():
        assert same_bits(got["model"][k], v), k


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_export_of_a_type_safetensors_lacks_is_one_clear_error(tmp_path, name):
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": bits(name, (4, 4))}}).result()
    out = tmp_path / "x.safetensors"
    run = _cli("export", "--format", "safetensors", root, out)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert f"has dtype torch.{name}, which safetensors cannot hold" in run.stderr
    assert "--format torch" in run.stderr
    assert not out.exists()


def test_a_dtype_still_refused_says_what_is_supported(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        chalf = torch.zeros(3, dtype=torch.complex32)
    with (
        Checkpointer(str(tmp_path / "job")) as ck,
        pytest.raises(CheckpointError, match="cannot be stored; supported dtypes: bool, ") as e,
    ):
        ck.save(1, {"s": {"c": chalf}})
    assert "float8_e4m3fn" in str(e.value) and "t.view(torch.uint8)" in str(e.value)


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_diff_compares_float8_by_bits(tmp_path):
    """``ckptd diff``: two saves of the same float8 bits (NaNs included) are equal; one bit
    flipped is one element 1 ULP apart, its distance in float8_e4m3fn's own values (a buffer
    of another 1-byte float8 type beside it is not reused for it)."""
    a = bits("float8_e4m3fn", (16, 16))
    scales = bits("float8_e8m0fnu", (16, 16), seed=1)
    b = a.clone()
    i = int((a.view(torch.uint8).reshape(-1) == 2).nonzero()[0])
    b.view(torch.uint8).view(-1)[i] = 3  # 2**-8 -> 1.5 * 2**-8 in float8_e4m3fn (subnormals)
    for root, t in (("a", a), ("same", a.clone()), ("b", b)):
        with Checkpointer(str(tmp_path / root)) as ck:
            ck.save(1, {"s": {"e8": scales, "w": t}}).result()
    same = _cli("diff", "--json", tmp_path / "a", tmp_path / "same")
    assert same.returncode == 0, same.stdout + same.stderr
    assert json.loads(same.stdout)["equal"] is True
    run = _cli("diff", "--json", tmp_path / "a", tmp_path / "b")
    assert run.returncode == 1, run.stderr
    rows = {t["key"]: t for t in json.loads(run.stdout)["tensors"]}
    assert rows["s/e8"]["status"] == "equal"
    assert rows["s/w"]["different"] == 1 and rows["s/w"]["max_ulps"] == 1
    assert rows["s/w"]["max_abs_diff"] == pytest.approx(2.0**-9)
