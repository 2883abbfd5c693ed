"""A daemon's save that fails lets go of its step, and a refusal keeps its kind, as in process.

Each test runs the daemon as the docs print it (a token file, its default socket, no
``--trust-tcp``) and a trainer with ``daemon=True``:

- the daemon's root PUTs of data fail (the S3 fault proxy in front of moto): the job fails, the
  daemon gives its claim up (``leases.abandon``), and another job takes the step at once, well
  within the 60 s lease that the claim would otherwise hold;
- another job's live lease holds step 5: the daemon's refusal reaches the trainer as
  ``StepHeld``, so the job skips 5 once, with one WARNING naming ``ckptd fence``, and commits 6.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from ckptd.errors import CheckpointError
from ckptd.verify import verify
from storage_backends import open_store
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.faults.slow_writer_job import state
from tests.faults.test_slow_writer import assert_holds, save_elsewhere, save_when_free, skips_a_held_step, wait_until
from tests.load import scaled
from tests.server.daemon import Daemon
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(600)


def _daemon(tmp_path, monkeypatch, root: str, **env: str) -> Daemon:
    """A daemon serving ``root`` with a token file on this test's default socket; the trainer's
    environment names the token file only."""
    token = tmp_path / "token"
    token.write_text("daemon-claims-test-token-0123456789")
    os.chmod(token, 0o600)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(token))
    sock = os.environ["CKPTD_SOCKET"]  # this test's default socket (tests/conftest.py)
    return Daemon([root], None, tmp_path / "d.log", token_file=token, trust_tcp=False, CKPTD_SOCKET=sock, **env)


@pytest.mark.s3
def test_a_daemon_save_that_fails_gives_its_step_up_at_once(s3_server, s3_bucket, tmp_path, monkeypatch):
    """Every data PUT of the daemon fails: job A's save fails, and job B saves the step at once
    (in half the default 60 s lease, which A's claim, renewed until the upload failed, would
    otherwise hold) and commits it."""
    monkeypatch.delenv("CKPTD_CLAIM_LEASE_S", raising=False)
    root = f"{s3_bucket}/run"
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "PutObject" and "/arrays/" in r.path, "500", times=10**6)])
    with FaultProxy(s3_server, plan) as proxy:
        env = {"AWS_ENDPOINT_URL": proxy.url, "CKPTD_S3_MAX_ATTEMPTS": "1", "CKPTD_UPLOAD_RETRIES": "0"}
        with _daemon(tmp_path, monkeypatch, s3_bucket, **env) as d:
            with Checkpointer(root, job_id="job-a", daemon=True) as ck, pytest.raises(CheckpointError):
                ck.save(3, state(1)).result(timeout=120)
            assert proxy.counters["fault:500"] >= 1, d.logs()
    assert save_when_free(root, "job-b", 2, 3, timeout=30) == 0  # not refused once; straight to moto
    assert_holds(root, 3, 2, "job-b")


@pytest.mark.s3
def test_a_daemon_save_abandoned_at_its_save_timeout_lets_go_at_once(s3_server, s3_bucket, tmp_path, monkeypatch):
    """The fault proxy holds the daemon's data PUTs: job A's save fails at its ``save_timeout``
    (5 s) with them in flight. The daemon gives A's claim up at that deadline, not when the held
    PUTs come back, so job B -- another process, writing straight to the store -- saves the step
    on its first try and commits it (A's claim, heartbeated until the deadline, would otherwise
    hold it for the 60 s lease). A's PUTs, released after B's commit, change nothing of B's."""
    monkeypatch.delenv("CKPTD_CLAIM_LEASE_S", raising=False)
    monkeypatch.delenv("CKPTD_STALE_ATTEMPT_S", raising=False)
    root = f"{s3_bucket}/run"
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "PutObject" and "/arrays/" in r.path, "late", times=10**6)])
    with FaultProxy(s3_server, plan) as proxy:
        try:
            env = {"AWS_ENDPOINT_URL": proxy.url, "CKPTD_UPLOAD_RETRIES": "0"}
            with _daemon(tmp_path, monkeypatch, s3_bucket, **env) as d:
                ck = Checkpointer(root, job_id="job-a", daemon=True, save_timeout=5.0)
                with ck, pytest.raises(CheckpointError, match="not committed 5 s after hand-off"):
                    ck.save(3, state(1)).result(timeout=scaled(120))
                assert proxy.counters["fault:late"] >= 1, d.logs()  # given up with its data PUTs held
                refused = save_elsewhere(root, "job-b", 2, 3, tmp_path / "b")  # one try: no wait for a lease
                assert refused is None, f"{refused}\n{d.logs()}"
                assert_holds(root, 3, 2, "job-b")
                assert "gave its claim up" in d.logs()
                proxy.release_late()  # A's PUTs land now, after B's commit
                wait_until(lambda: "step 3 rank 0 failed" in d.logs(), "the daemon to finish A's job", scaled(120))
        finally:
            proxy.release_late()
    assert_holds(root, 3, 2, "job-b")
    with open_store(root) as store:
        assert not verify(store, 3).warnings  # nothing of A's landed in B's step


def test_a_daemon_upload_past_the_trainers_deadline_is_given_up(tmp_path, monkeypatch):
    """Each shard put of the daemon takes 8 s; job A's trainer gives the save up after its
    ``commit_timeout`` (2 s). The daemon gives it up too: it writes no more, never commits the
    step (the trainer was told it failed), and lets go of its claim, so job B, once the daemon
    says the job failed, takes the step on its first try -- A's lease, renewed until then,
    would otherwise hold it for 60 s more."""
    monkeypatch.delenv("CKPTD_CLAIM_LEASE_S", raising=False)
    root = f"file://{tmp_path / 'jobs' / 'run'}"
    d = _daemon(tmp_path, monkeypatch, str(tmp_path / "jobs"), CKPTD_UPLOAD_RETRIES="0")
    d.upload_delay_s = 8.0
    with d:
        with Checkpointer(root, job_id="job-a", daemon=True, commit_timeout=2.0) as ck, pytest.raises(CheckpointError):
            ck.save(3, state(1)).result(timeout=120)
        wait_until(
            lambda: "step 3 rank 0 failed: not committed 2 s after hand-off" in d.logs(),
            "the daemon to give the job up",
        )
        assert save_when_free(root, "job-b", 2, 3) == 0, d.logs()  # not refused once
    assert_holds(root, 3, 2, "job-b")


def test_a_step_a_live_lease_holds_is_skipped_once_through_the_daemon(tmp_path, monkeypatch, caplog):
    """Job A holds a live lease on step 5 (a real writer process, held while writing it). Job B,
    through the daemon, reaches step 5: the daemon refuses it, B skips 5 with one WARNING naming
    ``ckptd fence``, and saves and commits step 6."""
    root = f"file://{tmp_path / 'jobs' / 'run'}"
    daemon = _daemon(tmp_path, monkeypatch, str(tmp_path / "jobs"))

    @contextlib.contextmanager
    def job_b():
        with daemon, Checkpointer(root, job_id="job-b", daemon=True) as ck:
            yield ck

    skips_a_held_step(root, tmp_path / "a", caplog, job_b)
