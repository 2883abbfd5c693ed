"""A writer that is slow but alive, then late (issue 26 part 1): its step is taken over only
after its lease ran out, and its late writes can neither replace nor delete what the new owner
committed. Real processes stopped with SIGSTOP on a local root; real S3 requests held by the
fault proxy in front of moto (and Ceph RGW where it runs)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptd import catalog, claims
from ckptd import manifest as mf
from ckptd.errors import AlreadyCommitted, CheckpointError, StepClaimed
from ckptd.verify import verify
from storage_backends import open_store
from storage_backends.s3 import S3Store
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.faults.slow_writer_job import state
from tests.load import scaled
from trainer_hooks import Checkpointer
from trainer_hooks.hook import CheckpointHook

ROOT = Path(__file__).resolve().parents[2]
LEASE = "2"

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture
def short_lease(monkeypatch):
    monkeypatch.setenv("CKPTD_CLAIM_LEASE_S", LEASE)
    monkeypatch.setenv("CKPTD_STALE_ATTEMPT_S", LEASE)  # what the data-age takeover used before


def wait_until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def save_when_free(root: str, job_id: str, seed: int, step: int, timeout: float = 120.0) -> int:
    """Save ``step`` as ``job_id``, retrying while the step is claimed by a live writer (one
    fresh Checkpointer per try); returns how many tries were refused."""
    refused = 0
    deadline = time.monotonic() + timeout
    while True:
        with Checkpointer(root, job_id=job_id) as ck:
            try:
                ck.save(step, state(seed)).result(timeout=120)
                return refused
            except StepClaimed:
                refused += 1
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} could not save step {step} in {timeout} s")
        time.sleep(0.1)


def save_elsewhere(root: str, job_id: str, seed: int, step: int, out: Path) -> str | None:
    """Save ``step`` as ``job_id`` once (no retry), in a process of its own (``slow_writer_job``,
    let go at once) writing straight to the store; output in ``out``. Returns its error, None
    once it committed."""
    out.mkdir()
    b = start_writer(root, job_id, seed, step, out)
    log, _ = b.communicate("go\n", timeout=scaled(240))
    assert b.returncode == 0, log[-4000:]
    return json.loads((out / "result.json").read_text())["error"]


def assert_holds(root: str, step: int, seed: int, job_id: str) -> None:
    """The committed step is ``job_id``'s, verifies, and restores its values bitwise."""
    store = open_store(root)
    try:
        assert catalog.read_commit(store, step)["writer"] == job_id
        report = verify(store, step)
        assert report.ok, report.errors
    finally:
        store.close()
    got = {"t": {k: torch.zeros(32, 32) for k in state(0)["t"]}, "seed": None}
    with Checkpointer(root) as ck:
        assert ck.restore(got, step=step) == step
    want = state(seed)
    assert got["seed"] == seed
    for k, t in want["t"].items():
        assert torch.equal(got["t"][k], t), f"step {step}: {k} is not {job_id}'s"


def start_writer(root: str, job_id: str, seed: int, step: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.faults.slow_writer_job", root, job_id, str(seed), str(step), str(out)],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def writing_writer(root: str, job_id: str, seed: int, step: int, out: Path) -> subprocess.Popen:
    """A writer process (``slow_writer_job``, output in ``out``) once it is writing ``step``:
    it has claimed the step and holds its lease until the caller lets it finish (``go`` on its
    stdin) or kills it. Killed here if it exits or does not start writing in time."""
    out.mkdir()
    a = start_writer(root, job_id, seed, step, out)
    try:
        wait_until(lambda: (out / "writing").exists() or a.poll() is not None, f"writer {job_id} to start writing")
        assert a.poll() is None, a.stdout.read()
    except BaseException:
        a.kill()
        a.communicate()
        raise
    return a


def skips_a_held_step(root: str, out: Path, caplog, job_b) -> str:
    """Job A (a real writer process) holds a live lease on step 5 over a committed step 4; job B
    (``job_b()``: a context manager giving its ``Checkpointer``) resumes at 5 and reaches step 5:
    it skips 5 with one WARNING naming ``ckptd fence`` and no ERROR, and commits step 6. Then A,
    alive all along, commits step 5. Returns the WARNING's text."""
    with Checkpointer(root, job_id="job-a") as ck:
        ck.save(4, state(0)).result(timeout=120)
    a = writing_writer(root, "job-a", 1, 5, out)
    try:
        with job_b() as ck, caplog.at_level(logging.WARNING, "ckptd"):
            hook = CheckpointHook(ck, state(3), every_n_steps=1, save_on_signal=False)
            try:
                assert hook.resume() == 5  # state(3) now holds step 4's values: state(0)
                hook.after_step(5)  # refused in the background: A's claim is alive
                hook.after_step(6)  # skips 5, saves 6
            finally:
                hook.close()  # waits for step 6's commit; raises if it failed
        store = open_store(root)
        try:
            assert catalog.committed_steps(store) == [4, 6]
            assert claims.owner(store, 5)["writer"] == "job-a"  # B wrote nothing there
        finally:
            store.close()
        assert_holds(root, 6, 0, "job-b")
        fence_lines = [r for r in caplog.records if "ckptd fence" in r.getMessage()]
        assert len(fence_lines) == 1 and fence_lines[0].levelno == logging.WARNING, fence_lines
        assert "step 5 skipped, saving step 6 instead" in fence_lines[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
        a.stdin.write("go\n")  # A was alive all along: it finishes and commits step 5
        a.stdin.flush()
        log_a, _ = a.communicate(timeout=240)
        assert a.returncode == 0, log_a[-4000:]
    finally:
        if a.poll() is None:
            a.kill()
            a.communicate()
    store = open_store(root)
    try:
        assert catalog.committed_steps(store) == [4, 5, 6]
        assert catalog.read_commit(store, 5)["writer"] == "job-a"
    finally:
        store.close()
    return fence_lines[0].getMessage()


@pytest.mark.parametrize("same_id", [False, True], ids=["another_job", "same_job_restarted"])
def test_a_stopped_local_writer_never_mixes_or_deletes_the_new_commit(tmp_path, short_lease, same_id):
    root = str(tmp_path / "root")
    out = tmp_path / "a"
    a = writing_writer(root, "job-a", 1, 5, out)
    try:
        b_id = "job-a" if same_id else "job-b"
        if not same_id:
            # A is slow but alive (its heartbeat renews its lease): B is refused, not let in
            with Checkpointer(root, job_id=b_id) as ck, pytest.raises(StepClaimed, match="last heartbeat"):
                ck.save(5, state(2)).result(timeout=120)
        os.kill(a.pid, signal.SIGSTOP)  # A stops (a GC pause, a frozen node): no more heartbeats
        save_when_free(root, b_id, 2, 5)  # B takes over once A's lease ran out, and commits
        assert_holds(root, 5, 2, b_id)
        os.kill(a.pid, signal.SIGCONT)  # A wakes up and finishes its writes, late
        a.stdin.write("go\n")
        a.stdin.flush()
        log, _ = a.communicate(timeout=240)
        assert a.returncode == 0, log[-4000:]
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.communicate()
    err = json.loads((out / "result.json").read_text())["error"]
    assert err is not None, "the late writer was told its save committed"
    # neither A's late writes nor its cleanup touched B's commit
    assert_holds(root, 5, 2, b_id)


@pytest.mark.s3
@pytest.mark.parametrize("save_timeout", [1800.0, 1.0], ids=["waiting", "abandoned"])
def test_an_s3_writer_whose_puts_land_late_never_mixes_the_new_commit(
    s3_target, short_lease, monkeypatch, save_timeout
):
    """ "abandoned": A's save_timeout expires while its PUTs are held (its future fails at once,
    and it gives its claim up); its writes land later, and then its cleanup runs -- and must
    delete nothing of B's."""
    held = FaultPlan(
        rules=[
            Rule(lambda r: r.op == "PutObject" and "/arrays/" in r.path, "late", times=10**6),
        ]
    )
    partitioned = []
    held.rules.append(Rule(lambda r: bool(partitioned) and "/alive/" in r.path, "500", times=10**6))
    with FaultProxy(s3_target.url, held) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("CKPTD_S3_MAX_ATTEMPTS", "1")
        ck_a = Checkpointer(s3_target.root, job_id="job-a", save_timeout=save_timeout)  # through the proxy
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_target.url)
        try:
            fut = ck_a.save(3, state(1))
            wait_until(lambda: proxy.counters["fault:late"] >= 1, "A's first data write to be held")
            if save_timeout > 10:  # alive (heartbeats pass), its data slow: B is refused
                with Checkpointer(s3_target.root, job_id="job-b") as ck, pytest.raises(StepClaimed):
                    ck.save(3, state(2)).result(timeout=120)
            partitioned.append(1)  # A can no longer renew its lease, its data PUTs still in flight
            save_when_free(s3_target.root, "job-b", 2, 3)
            assert_holds(s3_target.root, 3, 2, "job-b")
            proxy.release_late()  # A's held PUTs land now, after B's commit
            with pytest.raises(Exception):  # noqa: B017 - A learns its save failed
                fut.result(timeout=240)
            assert bool(ck_a._sink._abandoned) == (save_timeout < 10)
            for _, t in ck_a._sink._abandoned:  # an abandoned save's thread: its late writes, its cleanup
                t.join(240)
                assert not t.is_alive()
        finally:
            proxy.release_late()
            ck_a.close()
        assert proxy.counters["fault:late"] >= 1
    assert_holds(s3_target.root, 3, 2, "job-b")


def test_forged_claims_do_not_block_saves(tmp_path, short_lease):
    # a claim dated 10 years ahead, then one numbered 999999: the next claim is 1000000 (read
    # back), and each forged claim only blocks for a lease
    root = str(tmp_path / "root")
    store = open_store(root)
    store.put(claims.claim_key(4, 0), mf.dumps({"writer": "mallory", "attempt": "m1", "time": 4e9}))
    future = time.time() + 10 * 365 * 86400
    path = tmp_path / "root" / mf.step_dir(4) / mf.CLAIMS / "000000.json"
    os.utime(path, (future, future))
    save_when_free(root, "job-b", 2, 4)
    assert_holds(root, 4, 2, "job-b")
    store.put(claims.claim_key(6, 999999), mf.dumps({"writer": "mallory", "attempt": "m2", "time": 4e9}))
    save_when_free(root, "job-b", 3, 6)
    assert [n for n, _ in claims.claims(store, 6)] == [999999, 1000000]
    assert_holds(root, 6, 3, "job-b")
    store.close()


def _is_data_put(r) -> bool:
    return r.op == "PutObject" and "/arrays/" in r.path


@pytest.mark.s3
def test_an_abandoned_save_lets_go_of_its_step_at_once(s3_server, s3_bucket, tmp_path, monkeypatch):
    """A's data PUTs are held by the proxy past its ``save_timeout``: its future fails, its
    heartbeat stops and its claim is given up, so job B (another process) takes the step over on
    its first try -- within the default 60 s lease, which A's heartbeat would otherwise have
    renewed for as long as its process lived ("last heartbeat 0 s ago") -- and commits it; A's
    late writes, landing after, change nothing of B's."""
    held = FaultPlan(rules=[Rule(_is_data_put, "late", times=10**6)])
    with FaultProxy(s3_server, held) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ck_a = Checkpointer(s3_bucket, job_id="job-a", save_timeout=5.0)  # through the proxy
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
        try:
            fut = ck_a.save(3, state(1))
            with pytest.raises(CheckpointError, match="save_timeout"):
                fut.result(timeout=120)
            assert proxy.counters["fault:late"] >= 1  # abandoned with its data PUTs in flight
            refused = save_elsewhere(s3_bucket, "job-b", 2, 3, tmp_path / "b")  # another process, one try
            assert refused is None, refused
            assert_holds(s3_bucket, 3, 2, "job-b")
            proxy.release_late()
            for _, t in ck_a._sink._abandoned:  # A's stuck thread: its late writes, its cleanup
                t.join(240)
                assert not t.is_alive()
        finally:
            proxy.release_late()
            ck_a.close()
    assert_holds(s3_bucket, 3, 2, "job-b")


@pytest.mark.s3
def test_a_writer_throttled_at_the_floor_keeps_its_lease(s3_server, s3_bucket, monkeypatch):
    """The first 60 data PUTs of A's save are answered SlowDown, so its store paces the step's
    data at the floor with 16 upload threads queued; meanwhile job B tries to take the step every
    half second. A's heartbeats are paced apart from its data, so B is refused every time and A
    commits. Scaled from the defaults (a 60 s lease, a 0.2 requests/s floor: a heartbeat queued
    behind 16 reservations went out 80 s late): lease 8 s, floor 2 requests/s (16 reservations:
    8 s, and more with the debt a cut left), about 30 s of throttling."""
    monkeypatch.setenv("CKPTD_CLAIM_LEASE_S", "8")
    monkeypatch.setenv("CKPTD_S3_MIN_RATE", "2")
    plan = FaultPlan(rules=[Rule(_is_data_put, "503", times=60)])
    bucket, _, prefix = s3_bucket.removeprefix("s3://").partition("/")
    taken: list = []
    with FaultProxy(s3_server, plan) as proxy, S3Store(bucket, prefix, endpoint_url=s3_server) as other:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        g = torch.Generator().manual_seed(7)
        big = {"t": {f"w{i:02d}": torch.randn(8, 8, generator=g) for i in range(64)}}
        with Checkpointer(s3_bucket, job_id="job-a") as ck:
            fut = ck.save(1, big)
            wait_until(lambda: proxy.counters["fault:503"] >= 1, "A's first data write (after its claim)")
            while not fut.done():
                try:
                    claims.begin(other, 1, "attempt-b", "job-b")
                    taken.append(time.monotonic())  # a takeover: the live writer lost its step
                    break
                except StepClaimed:
                    time.sleep(0.5)
                except AlreadyCommitted:
                    break
            result = fut.exception(timeout=240)
            throttled, limiter = proxy.counters["fault:503"], ck.store.limiter
        assert not taken, f"job B took over a live writer's step ({result})"
        assert result is None
        assert throttled == 60 and limiter.cuts >= 1 and limiter.waits >= 16  # the data was paced
        assert catalog.latest_step(other) == 1
        assert catalog.read_commit(other, 1)["writer"] == "job-a"
