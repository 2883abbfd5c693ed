"""The harness's timeout multiplier and retries (tests/load.py) and the failure text of a child
that timed out, with real child processes and a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests import load
from tests.s3server import answers

REPO = Path(__file__).resolve().parents[2]


def _child(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=load.scaled(120),  # idle: ~1 s
    )


def test_the_scale_comes_from_the_environment_else_from_the_load():
    code = "from tests import load; print(load.SCALE)"
    assert _child("-c", code, CKPTD_TEST_TIMEOUT_SCALE="4").stdout.strip() == "4.0"
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_TEST_TIMEOUT_SCALE"}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, **_quick())
    assert 1.0 <= float(p.stdout) <= load.MAX_AUTO_SCALE, p.stdout + p.stderr
    p = _child("-c", code, CKPTD_TEST_TIMEOUT_SCALE="0.5")
    assert p.returncode != 0 and "must be a number >= 1" in p.stderr


def _quick() -> dict:
    return {"capture_output": True, "text": True, "timeout": load.scaled(120)}


def test_a_timed_out_child_leaves_its_output_in_the_error():
    code = "import sys, time; print('out-line', flush=True); print('err-line', file=sys.stderr, flush=True); "
    with pytest.raises(AssertionError) as e:
        load.run([sys.executable, "-c", code + "time.sleep(600)"], 3)  # idle, the lines come in ~0.05 s
    assert "out-line" in str(e.value) and "err-line" in str(e.value)


def test_a_timeout_in_a_test_reports_the_childs_output(tmp_path):
    """conftest's report hook: a bare ``subprocess.run(..., timeout=)`` that expires."""
    (tmp_path / "test_child.py").write_text(
        textwrap.dedent(
            """
            import subprocess, sys
            def test_child():
                code = "import time; print('marker-from-the-child', flush=True); time.sleep(600)"
                subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=5)
            """
        )
    )
    p = _child("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(tmp_path / "test_child.py"))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "child stdout (TimeoutExpired)" in p.stdout and "marker-from-the-child" in p.stdout, p.stdout


def test_retry_retries_only_what_it_is_told_is_transient(caplog):
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("starting")
        return 42

    assert load.retry(flaky, lambda r: isinstance(r, ConnectionRefusedError), "flaky", pause=0.01) == 42
    assert len(calls) == 3
    assert [r.levelname for r in caplog.records if r.name == "tests.load"] == ["WARNING", "WARNING"]

    calls.clear()
    with pytest.raises(ValueError):
        load.retry(lambda: calls.append(1) or int("x"), lambda r: isinstance(r, OSError), "bad", pause=0.01)
    assert len(calls) == 1  # not transient: raised at once

    calls.clear()
    with pytest.raises(ConnectionRefusedError):  # bounded: the last error comes out as it is
        load.retry(lambda: calls.append(1) or flaky_forever(), lambda r: True, "down", attempts=3, pause=0.01)
    assert len(calls) == 3


def flaky_forever():
    raise ConnectionRefusedError("down")


def test_a_server_answering_5xx_is_not_up_yet():
    """A gateway still starting answers 503; the start-up loops keep waiting for it."""
    status = [503]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(status[0])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/"
        assert not answers(url)
        status[0] = 403  # serving, anonymous access refused: up
        assert answers(url)
    finally:
        server.shutdown()
        server.server_close()
