"""A real S3-compatible server on loopback for tests: moto's standalone server in a subprocess.

Nothing is mocked: the code under test talks HTTP to a separate process, as it would to MinIO
or AWS. ``tests/conftest.py`` wraps this in the ``s3_server`` and ``s3_bucket`` fixtures; other
tools (benchmarks, demos) can call ``start_moto_server`` directly.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from tests.load import deadline as load_deadline
from tests.load import scaled
from tests.local_launch import free_port

# What boto3 needs to talk to the server; set by the s3_server fixture for the whole session.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def client(url: str, credentials: dict[str, str] | None = None):
    """A boto3 S3 client of the server at ``url`` with explicit credentials (``CREDENTIALS`` by
    default): boto3's default session keeps the first ones it found, which may be another
    server's."""
    import boto3

    creds = credentials or CREDENTIALS
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name=creds["AWS_REGION"],
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
    )


def answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status below 500 counts: it is serving; a
    5xx is a server still starting up, asked again by the caller's loop)."""
    try:
        with urllib.request.urlopen(url, timeout=scaled(1)):
            return True
    except urllib.error.HTTPError as e:
        return e.code < 500  # any other HTTP answer means it is serving
    except OSError:
        return False


def start_moto_server(timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m moto.server`` on a free loopback port; returns (process, endpoint URL)
    once it answers HTTP. Its log goes to a temp file, shown if it fails to start."""
    for _ in range(3):  # the free port may be taken between our probe and the server's bind
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="moto-server-", suffix=".log", delete=False)  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        log.close()
        deadline = load_deadline(timeout)  # idle start-up: ~2 s
        while time.monotonic() < deadline and proc.poll() is None:
            if answers(url + "/moto-api/"):
                return proc, url
            time.sleep(0.1)
        stop(proc)
        with open(proc.log_path, errors="replace") as f:  # type: ignore[attr-defined]
            tail = f.read()[-2000:]
        if "Address already in use" not in tail:
            raise RuntimeError(f"moto server did not start on {url}:\n{tail}")
    raise RuntimeError("moto server could not find a free port")


def terminate(proc: subprocess.Popen) -> None:
    """Stop a server process by its pid: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(10))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=scaled(10))


def stop(proc: subprocess.Popen) -> None:
    """Stop the server by its pid (SIGTERM, then SIGKILL) and remove its log."""
    terminate(proc)
    log_path = getattr(proc, "log_path", None)
    if log_path:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
