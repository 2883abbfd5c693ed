"""A storage endpoint that stops answering must not hang training: ``save`` never talks to
storage (it returns at the snapshot), and the save's future fails with a clear error within
the configured bound -- ``save_timeout`` for the whole save, the S3 client's per-call timeouts
(``CKPTD_S3_*``) for each call. The endpoint is a real TCP server on loopback that accepts
connections and never answers.

Assertions are on outcomes, never on durations: the thread guards below are generous limits
against a hang (without the fix ``save`` blocked for about 40 minutes of retries)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from ckptd.errors import CheckpointError
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)
GUARD_S = 120  # far above any bound configured here


@pytest.fixture
def stalled_endpoint(monkeypatch):
    """``http://127.0.0.1:PORT``: accepts, reads nothing, answers nothing; AWS_* point at it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    for name, value in {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield url
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        srv.close()


def save_in_thread(ck: Checkpointer, step: int, state: dict):
    """``ck.save`` on a helper thread, so that a save that hangs fails the test instead of
    hanging it. Returns the future ``save`` returned."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("fut", ck.save(step, state)), daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive(), "save() blocked on a stalled storage endpoint"
    return box["fut"]


def test_save_deadline_fails_the_future(stalled_endpoint, monkeypatch):
    # each S3 call would wait up to 60 s (one attempt); the save's own deadline is 2 s
    monkeypatch.setenv("CKPTD_S3_READ_TIMEOUT", "60")
    monkeypatch.setenv("CKPTD_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("CKPTD_S3_RETRIES", "0")
    ck = Checkpointer("s3://stalled/job", save_timeout=2)
    state = {"w": torch.randn(32, 32)}
    fut = save_in_thread(ck, 1, state)
    exc = fut.exception(timeout=GUARD_S)
    assert isinstance(exc, CheckpointError) and "storage did not answer" in str(exc), exc
    assert "save_timeout" in str(exc)
    # the failure was looked at, so the job may go on (the next save fails the same way)
    fut2 = save_in_thread(ck, 2, state)
    assert isinstance(fut2.exception(timeout=GUARD_S), CheckpointError)
    ck.close()


def test_s3_call_timeouts_fail_the_future(stalled_endpoint, monkeypatch):
    # no save deadline to speak of: each S3 call's own timeout ends it
    monkeypatch.setenv("CKPTD_S3_READ_TIMEOUT", "1")
    monkeypatch.setenv("CKPTD_S3_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("CKPTD_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("CKPTD_S3_RETRIES", "0")
    ck = Checkpointer("s3://stalled/job")
    fut = save_in_thread(ck, 1, {"w": torch.randn(32, 32)})
    exc = fut.exception(timeout=GUARD_S)
    assert isinstance(exc, CheckpointError), exc
    assert stalled_endpoint in str(exc) and "timeout" in str(exc).lower(), exc
    ck.close()
