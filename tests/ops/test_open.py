"""``ckptd.open_array`` / ``ckptd.open_group``: a 3-rank FSDP checkpoint (real gloo ranks) on a
local root and on the loopback S3 server, read in a subprocess that never imports torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

import ckptd
from ckptd.errors import CheckpointError, CheckpointNotFoundError
from tests.distributed import launch
from tests.distributed.scenarios import build
from tests.s3server import CREDENTIALS

pytestmark = [pytest.mark.slow, pytest.mark.s3]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3_server):
    """Step 1 of the same state on a local root and on S3, saved by 3 FSDP ranks; references
    as .npy files; a partial step 2 beside it on both."""
    base = tmp_path_factory.mktemp("open")
    bucket = f"ckptd-open-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name=CREDENTIALS["AWS_REGION"])
    s3.create_bucket(Bucket=bucket)
    local, remote = str(base / "job"), f"s3://{bucket}/team/job"
    launch.run(3, "save_fsdp", base / "out", scenarios="tests.ops.scenarios", roots=[local, remote])
    refs = base / "refs"
    refs.mkdir()
    model, _, _ = build("single", 0)
    g = torch.Generator().manual_seed(0)
    bf16 = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    for k, v in model.state_dict().items():
        np.save(refs / f"model__{k}.npy", v.numpy())
    np.save(refs / "extra__bf16.npy", bf16.view(torch.int16).numpy().view(np.uint16))
    # a partial step: data without a commit record
    shutil.copytree(Path(local, "step_0000000001"), Path(local, "step_0000000002"))
    os.remove(Path(local, "step_0000000002", "commit.json"))
    s3.put_object(Bucket=bucket, Key="team/job/step_0000000002/manifest.json", Body=b"{}")
    yield local, remote, refs
    objs = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    if objs:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": objs})
    s3.delete_bucket(Bucket=bucket)
    s3.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_read_without_torch(saved, where):
    local, remote, refs = saved
    uri = local if where == "local" else remote
    env = {**os.environ, "PYTHONPATH": f"{launch.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, str(HERE / "read_without_torch.py"), uri, str(refs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch_imported"] is False
    assert "extra/bf16" in out["checked"] and "model/fc1.weight" in out["checked"]


@pytest.mark.timeout(300)
def test_docs_example_runs_without_torch(saved, tmp_path):
    """The notebook example of docs/operations-ui.md, on the 3-rank checkpoint on S3."""
    _, remote, _ = saved
    doc = (launch.ROOT / "docs" / "operations-ui.md").read_text()
    code = doc.split("<!-- example: open_array", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code, n = re.subn(r'^uri = "[^"]*"', f"uri = {remote!r}", code, flags=re.M)
    assert n == 1
    script = tmp_path / "example.py"
    script.write_text(code + "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "PYTHONPATH": f"{launch.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith("(24, 16) float32\n"), r.stdout


@pytest.mark.parametrize("where", ["local", "s3"])
def test_only_committed_steps_open(saved, where):
    local, remote, _ = saved
    uri = local if where == "local" else remote
    for fn in (lambda: ckptd.open_array(uri, "model/fc1.weight", step=2), lambda: ckptd.open_group(uri, step=2)):
        with pytest.raises(CheckpointNotFoundError, match="partial"):
            fn()
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        ckptd.open_array(uri, "model/fc1.weight", step=3)
    with pytest.raises(CheckpointError, match="no array 'model/nope'"):
        ckptd.open_array(uri, "model/nope")
    # the default is the latest committed step (1), not the newer partial one
    assert ckptd.open_array(uri, "model/gate").shape == (3,)
