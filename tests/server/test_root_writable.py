"""A daemon whose root it cannot write refuses to start, with the reason: one error line, exit 2,
nothing served; otherwise every hand-off it accepted would fail at upload, after the trainers
had moved on. Real ``ckptd serve`` processes, a real local path and the moto S3 server."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from storage_backends import open_store
from tests.distributed import launch
from tests.security.conftest import REPO
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.timeout(180)]


def _serve(tmp_path, root: str) -> subprocess.CompletedProcess:
    token = tmp_path / "token"
    token.write_text("t0ken-for-the-root-tests\n")
    os.chmod(token, 0o600)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", root, "--token-file", str(token)]
    args += ["--port", str(launch.free_port()), "--staging-dir", str(tmp_path / "staging")]
    return subprocess.run(args, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120)


def _refused(out: subprocess.CompletedProcess, root: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("ckptd: error:")]
    assert len(errors) == 1 and f"refusing to serve {root}" in errors[0], out.stderr
    assert "cannot write" in errors[0] and "Traceback" not in out.stderr and "Uvicorn running" not in out.stderr


def test_a_local_root_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    root = str(tmp_path / "file" / "jobs")  # root can write anywhere, but not below a regular file
    _refused(_serve(tmp_path, root), root)


def test_an_s3_root_in_a_missing_bucket_is_refused(tmp_path, s3_server):
    root = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/jobs"
    _refused(_serve(tmp_path, root), root)


def test_a_writable_root_is_probed_and_left_clean(tmp_path, s3_bucket):
    local = str(tmp_path / "jobs")
    with Daemon([local, s3_bucket], tmp_path / "staging", tmp_path / "daemon.log") as d:
        assert d.get("/healthz")[0] == 200
    for root in (local, s3_bucket):
        assert [o.key for o in open_store(root).list("")] == [], root
