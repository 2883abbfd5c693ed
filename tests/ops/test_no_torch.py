"""Operations without torch (issue 28, item 14): ``pip install 'ckptd[server]'`` into a plain
venv pulls no torch, and there ``ckptd ls``, ``verify``, ``serve``, ``open_array`` and
``open_group`` work on a checkpoint a torch trainer saved (local and S3); ``import trainer_hooks``
and ``ckptd export`` fail with one line naming the extra to install. An S3 read through
tensorstore logs nothing on success, even with no ``~/.aws`` files.

The venv is real (``python -m venv``, no system site-packages), filled by pip from its cache
(about 50 s here), once for the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from tests import load
from tests.distributed import launch
from tests.s3server import CREDENTIALS
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv with ckptd[server] installed from this checkout, and without torch."""
    where = tmp_path_factory.mktemp("venv")
    # pip builds in the source folder (build/, *.egg-info): build from a copy, not the checkout
    src = tmp_path_factory.mktemp("src")
    for name in ("ckptd", "trainer_hooks", "storage_backends"):
        shutil.copytree(launch.ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(launch.ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    py = where / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{src}[server]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return where


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3_server) -> tuple[str, str]:
    """Step 1 of a small state saved with torch, on a local root and on S3."""
    base = tmp_path_factory.mktemp("saved")
    bucket = f"ckptd-notorch-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name=CREDENTIALS["AWS_REGION"]).create_bucket(Bucket=bucket)
    roots = (str(base / "job"), f"s3://{bucket}/job")
    state = {"w": torch.arange(24, dtype=torch.float32).reshape(6, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    for root in roots:
        with Checkpointer(root) as ck:
            ck.save(1, state).result()
    return roots


def _run(venv: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """A command of the venv, outside this checkout (cwd), with no ~/.aws files (HOME)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    }
    env["HOME"] = str(tmp_path)
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )


READ = """
import sys, numpy as np, ckptd
got = ckptd.open_array(sys.argv[1], "w").read().result()
assert np.array_equal(got, np.arange(24, dtype=np.float32).reshape(6, 4)), got
if sys.argv[1].startswith("/"):  # open_group on S3 needs obstore (the s3 extra), not installed here
    assert np.array_equal(ckptd.open_group(sys.argv[1])["arrays/w"][:], got)
assert "torch" not in sys.modules
print("read ok")
"""


def test_operations_without_torch(venv, saved, tmp_path):
    r = _run(venv, tmp_path, "python", "-c", "import torch")
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr  # really no torch there
    for root in saved:
        ls = _run(venv, tmp_path, "ckptd", "ls", root)
        assert ls.returncode == 0 and "1" in ls.stdout, ls.stderr
        v = _run(venv, tmp_path, "ckptd", "verify", root)
        assert v.returncode == 0, v.stdout + v.stderr
        rd = _run(venv, tmp_path, "python", "-c", READ, root)
        assert rd.returncode == 0 and "read ok" in rd.stdout, rd.stderr
        # a successful read logs nothing (tensorstore's credential chain parsed missing ~/.aws files)
        assert rd.stderr == "", rd.stderr
    th = _run(venv, tmp_path, "python", "-c", "import trainer_hooks")
    assert th.returncode != 0 and "ckptd[torch]" in th.stderr, th.stderr
    ex = _run(venv, tmp_path, "ckptd", "export", saved[0], "--format", "torch", str(tmp_path / "out.pt"))
    assert ex.returncode == 1 and ex.stderr.startswith("ckptd: error:") and "ckptd[torch]" in ex.stderr, ex.stderr


def test_serve_without_torch(venv, saved, tmp_path):
    port = launch.free_port()
    args = ["ckptd", "serve", "--root", saved[0], "--port", str(port), "--token-file", os.environ["CKPTD_TOKEN_FILE"]]
    args += ["--staging-dir", str(tmp_path / "staging")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([str(venv / "bin" / args[0]), *args[1:]], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        token = Path(os.environ["CKPTD_TOKEN_FILE"]).read_text().strip()
        url = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/checkpoints", headers={"Authorization": f"Bearer {token}"}
        )
        deadline = load.deadline(120)
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    body = json.loads(resp.read())
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
        assert [c["step"] for c in body] == [1], body
    finally:
        proc.terminate()
        proc.wait(timeout=30)
