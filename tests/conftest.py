"""Fixtures shared by every test folder.

``s3_server``: a real S3-compatible server (moto's standalone server, a subprocess on loopback)
for the whole session, with the standard AWS_* variables pointing at it, so that
``open_store("s3://...")`` works as it would against MinIO or AWS. ``s3_bucket``: a fresh bucket
per test, as a job root URI ``s3://bucket/job``. Mark such tests ``@pytest.mark.s3``.

``rgw_server``: a one-node Ceph cluster with its RADOS Gateway (tests/rgwserver.py), started
once per session, only when a test asks for it; skipped when Ceph's packages are absent, an
error with the daemons' logs when they are present but the cluster does not start.
``rgw_bucket``: a fresh bucket on it, with the AWS_* variables pointing at RGW for that test.
``s3_target``: the same test against both, moto and RGW (parametrized); mark with ``s3``.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests import load, rgwserver, s3server
from tests.s3server import CREDENTIALS, start_moto_server, stop

# Subprocesses (ranks, daemons, jobs) bound their waits with the same factor as this process.
os.environ.setdefault("CKPTD_TEST_TIMEOUT_SCALE", str(load.SCALE))


def pytest_report_header(config: pytest.Config) -> str:
    return f"ckptd timeouts: x{load.SCALE} (CKPTD_TEST_TIMEOUT_SCALE, else the load per core; tests/load.py)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest's timeout (a test's ``timeout`` mark, else ``--timeout``/the ini's) times
    ``load.SCALE``, as every bound inside the harness is: a loaded machine stretches both alike,
    so a subprocess's own timeout still fires first and its output reaches the report."""
    if load.SCALE == 1:
        return
    default = getattr(config, "_env_timeout", None)  # pytest-timeout's resolved --timeout/ini value
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = (marker.kwargs.get("timeout", marker.args[0] if marker.args else None)) if marker else default
        if not seconds:
            continue  # no timeout, or 0 (none): nothing to scale
        kwargs = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timeout"}
        args = tuple(marker.args[1:]) if marker and marker.args else ()
        item.add_marker(pytest.mark.timeout(float(seconds) * load.SCALE, *args, **kwargs), append=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A child that timed out (``subprocess.TimeoutExpired``) or failed a ``check=True`` run
    (``CalledProcessError``): what it wrote so far goes into the report, which would otherwise
    show only the command line."""
    outcome = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, subprocess.TimeoutExpired | subprocess.CalledProcessError):
        report = outcome.get_result()
        for name in ("stdout", "stderr"):
            text = load.tail(getattr(exc, name, None))
            if text:
                report.sections.append((f"child {name} ({type(exc).__name__})", text))


def point_aws_at(mp: pytest.MonkeyPatch, url: str, credentials: dict[str, str]) -> None:
    """Replace every AWS_* variable: the user's profiles, tokens and endpoints must never leak
    into tests."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        mp.delenv(name)
    for name, value in credentials.items():
        mp.setenv(name, value)
    mp.setenv("AWS_ENDPOINT_URL", url)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no slow instance-metadata lookups
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name in ("NO_PROXY", "no_proxy"):  # loopback must not go through a proxy
        mp.setenv(name, ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"])))


@pytest.fixture(autouse=True)
def _own_daemon_socket(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test's daemons and trainers default to a socket of the test's own (``CKPTD_SOCKET``,
    the variable the docs give two daemons on one machine), never the machine's default socket,
    which the daemons of other tests (or the machine's own) would hold."""
    base = tmp_path_factory.getbasetemp() / "sockets"
    base.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("CKPTD_SOCKET", str(base / uuid.uuid4().hex[:12] / "ckptd.sock"))


@pytest.fixture(autouse=True)
def _own_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test's daemons (tests/server/daemon.py) start with ``--token-file``, the file
    ``CKPTD_TOKEN_FILE`` names, and its trainers and CLI calls read the same file from their
    environment: the docs' setup (README: the job script exports ``CKPTD_TOKEN_FILE``). A test of
    a missing token removes the variable."""
    from tests.server.daemon import TOKEN

    folder = tmp_path_factory.getbasetemp() / "tokens" / uuid.uuid4().hex[:12]
    folder.mkdir(mode=0o700, parents=True)
    path = folder / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(path))
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL. AWS_* variables point at it for the rest of the session."""
    proc, url = start_moto_server()
    mp = pytest.MonkeyPatch()
    try:
        point_aws_at(mp, url, CREDENTIALS)
        yield url
    finally:
        mp.undo()
        stop(proc)


def _new_bucket(url: str, credentials: dict[str, str]) -> Iterator[str]:
    """A new, empty bucket; yields ``s3://<bucket>/job``. Emptied and removed afterwards."""
    bucket = f"ckptd-test-{uuid.uuid4().hex[:16]}"
    client = s3server.client(url, credentials)
    try:
        client.create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/job"
        for up in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        client.delete_bucket(Bucket=bucket)
    finally:
        client.close()


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[str]:
    """A new, empty bucket on moto; yields ``s3://<bucket>/job``."""
    yield from _new_bucket(s3_server, CREDENTIALS)


@pytest.fixture(scope="session")
def rgw_server() -> Iterator[str]:
    """The RGW endpoint URL; the AWS_* variables are left alone (``rgw_bucket`` sets them)."""
    missing = rgwserver.missing_binaries()
    if missing:
        pytest.skip(f"Ceph RGW not installed (apt-get install radosgw ceph-mon ceph-osd): no {missing}")
    server = rgwserver.start_rgw_server()
    try:
        yield server.url
    finally:
        rgwserver.stop(server)


@pytest.fixture
def rgw_bucket(rgw_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A new, empty bucket on RGW, with the AWS_* variables pointing at RGW for this test."""
    point_aws_at(monkeypatch, rgw_server, rgwserver.CREDENTIALS)
    yield from _new_bucket(rgw_server, rgwserver.CREDENTIALS)


@dataclass(frozen=True)
class S3Target:
    """One S3 implementation under test: ``name`` ("moto" or "rgw"), its endpoint ``url``, and
    ``root``, a fresh ``s3://bucket/job`` on it; the AWS_* variables point at it."""

    name: str
    url: str
    root: str

    @property
    def bucket(self) -> str:
        return self.root.split("/")[2]

    def client(self):
        """A boto3 client for it (``s3server.client``: explicit credentials)."""
        return s3server.client(self.url, rgwserver.CREDENTIALS if self.name == "rgw" else CREDENTIALS)


@pytest.fixture(params=["moto", "rgw"])
def s3_target(request: pytest.FixtureRequest) -> S3Target:
    if request.param == "moto":
        root = request.getfixturevalue("s3_bucket")
        return S3Target("moto", request.getfixturevalue("s3_server"), root)
    root = request.getfixturevalue("rgw_bucket")
    return S3Target("rgw", request.getfixturevalue("rgw_server"), root)
