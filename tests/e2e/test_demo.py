"""The examples end to end: the elastic demo in its reduced size, and ``train_elastic.py`` under
torchrun stopped by SIGTERM at 2 processes and resumed at 3."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd import catalog
from storage_backends import open_store
from tests import load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_elastic_demo_small(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "elastic_demo.py"), "--small", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),  # the demo finds its own files; no reliance on the working directory
        timeout=560,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    text = done.stdout
    assert "exactly once: 720 of 720 samples, each trained on once: PASS" in text
    assert "sending SIGTERM to rank 2" in text and "sending SIGTERM to rank 1" in text
    assert "elastic demo: OK" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exactly_once"] and summary["same_batches_as_reference"] and not summary["failures"]
    phases = summary["phases"]
    assert [p["world"] for p in phases] == [4, 3, 2]
    assert phases[0]["start"] == 0 and phases[2]["stop_step"] is None
    for prev, nxt in zip(phases, phases[1:], strict=False):
        assert nxt["start"] == prev["stop_step"] + 1
    assert summary["max_abs_loss_diff"] < 1e-3
    png = out / "elastic_demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = (out / "losses.csv").read_text().splitlines()
    assert len(rows) == 1 + 60


def torchrun(nproc: int, args: list[str], log: Path, restarts: int = 0) -> subprocess.Popen:
    # torchrun shares its rendezvous TCPStore with the workers by default, and a restarted group
    # can read the previous attempt's addresses from it (gloo: "Connection refused";
    # pytorch/pytorch#135712, #167288): a store per attempt avoids it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={restarts}",
                "--monitor-interval=0.2",
                str(EXAMPLES / "train_elastic.py"),
                *args,
            ],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )


def records(log_dir: Path) -> list[dict]:
    if not log_dir.exists():
        return []
    return [json.loads(line) for f in sorted(log_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


def wait_for_step(log_dir: Path, step: int, agent: subprocess.Popen, log: Path, timeout: float = 150) -> list[dict]:
    deadline = load.deadline(timeout)
    while True:
        recs = records(log_dir)
        if any(r["event"] == "step" and r["step"] >= step for r in recs):
            return recs
        assert agent.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.05)


def finish(agent: subprocess.Popen, timeout: float) -> int:
    try:
        return agent.wait(timeout=timeout)
    finally:
        if agent.poll() is None:
            agent.kill()


@pytest.mark.timeout(500)
def test_train_elastic_under_torchrun_sigterm_then_resume_at_3(tmp_path):
    root = str(tmp_path / "job")
    steps = 60
    args = ["--samples", str(12 * steps), "--seq-len", "16", "--dim", "32", "--layers", "1", "--root", root]
    args += ["--every", "0", "--step-delay", "0.05"]

    # torchrun with 2 workers; SIGTERM to torchrun itself, as Kubernetes or Slurm would send it:
    # torchrun forwards it to the workers, which save one agreed step and exit 0 (torchrun
    # itself then exits 1 with its SignalException)
    a_dir, a_log = tmp_path / "a", tmp_path / "a.log"
    agent = torchrun(2, [*args, "--log-dir", str(a_dir)], a_log)
    wait_for_step(a_dir, 5, agent, a_log)
    agent.send_signal(signal.SIGTERM)
    finish(agent, 120)
    a = records(a_dir)
    stops = {r["rank"]: r for r in a if r["event"] == "stop"}
    assert sorted(stops) == [0, 1], a_log.read_text()[-5000:]
    saved = stops[0]["step"]
    assert stops[1]["step"] == saved and stops[0]["signalled"] and stops[1]["signalled"]
    store = open_store(root)
    try:
        assert catalog.committed_steps(store) == [saved]
    finally:
        store.close()

    # the same command with 3 workers resumes at the next step. There, SIGTERM to one worker
    # only: it exits 0, its peers (not signalled) exit 75, so torchrun restarts the group
    # (--max-restarts=1), which resumes once more and finishes the epoch
    b_dir, b_log = tmp_path / "b", tmp_path / "b.log"
    agent = torchrun(3, [*args, "--log-dir", str(b_dir)], b_log, restarts=1)
    b = wait_for_step(b_dir, saved + 6, agent, b_log)
    pid = next(r["pid"] for r in b if r["event"] == "start" and r["rank"] == 2)
    os.kill(pid, signal.SIGTERM)
    assert finish(agent, 240) == 0, b_log.read_text()[-5000:]
    b = records(b_dir)
    stops = {r["rank"]: r for r in b if r["event"] == "stop"}
    assert sorted(stops) == [0, 1, 2] and len({r["step"] for r in stops.values()}) == 1
    assert [stops[r]["signalled"] for r in range(3)] == [False, False, True]
    saved_b = stops[0]["step"]
    starts = sorted((r["restart"], r["rank"], r["world"], r["step"]) for r in b if r["event"] == "start")
    assert starts == [(0, rank, 3, saved + 1) for rank in range(3)] + [(1, rank, 3, saved_b + 1) for rank in range(3)]
    assert {r["step"] for r in b if r["event"] == "done"} == {steps - 1}

    trained = collections.Counter(r["step"] for r in a + b if r["event"] == "step" and r["rank"] == 0)
    assert sorted(trained) == list(range(steps)) and set(trained.values()) == {1}
    seen = collections.Counter(i for r in a + b if r["event"] == "step" for i in r["indices"])
    assert sorted(seen) == list(range(12 * steps)) and set(seen.values()) == {1}
