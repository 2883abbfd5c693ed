"""Issue 27 item 10: ``ckptd serve --token-file F`` refuses a token file its group or other
local users can write (they could replace the token with one they know): one error line, exit
2, nothing served. A token every local user can read starts with one WARNING; 0600 starts
quietly. Real files, real modes, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed import launch
from tests.security.conftest import REPO
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.timeout(180)]

TOKEN = "t0ken-for-the-mode-tests"


def _token_file(tmp_path, mode: int):
    f = tmp_path / f"token-{mode:o}"
    f.write_text(TOKEN + "\n")
    os.chmod(f, mode)
    return f


@pytest.mark.parametrize("mode", [0o666, 0o622, 0o620, 0o602])
def test_a_token_file_others_can_write_is_refused(tmp_path, mode):
    f = _token_file(tmp_path, mode)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", str(tmp_path / "jobs")]
    args += ["--port", str(launch.free_port()), "--staging-dir", str(tmp_path / "staging"), "--token-file", str(f)]
    out = subprocess.run(args, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("ckptd: error:")]
    assert len(errors) == 1 and "writable" in errors[0] and f"{mode:o}" in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert "Uvicorn running" not in out.stderr


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, False), (0o600, False)])
def test_a_token_file_others_cannot_write_is_served(tmp_path, mode, warned):
    f = _token_file(tmp_path, mode)
    with Daemon([str(tmp_path / "jobs")], tmp_path / "staging", tmp_path / "daemon.log", token_file=f) as d:
        assert d.get("/v1/status", TOKEN)[0] == 200
        assert d.get("/v1/status", "wrong")[0] == 401
    assert ("readable by every local user" in d.logs()) == warned, d.logs()
