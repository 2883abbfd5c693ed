"""Real processes racing through the scalable commit on a filesystem root: exactly one commit,
none while a rank is missing (its process SIGKILLed), and a latest-step chain that stays
increasing when several processes commit steps at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd import catalog, donetree, latest
from ckptd import manifest as mf
from storage_backends import open_store
from tests import load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, root: str, mode: str, nprocs: int, world: int, hold: int | None = None):
    procs = []
    for p in range(nprocs):
        args = [root, mode, str(p), str(nprocs), str(world), str(tmp_path / f"out{p}")]
        if hold == p:
            args.append("hold")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.protocol.commit_race", *args],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        )
    (tmp_path / "go").write_text("")
    return procs


def _results(tmp_path: Path, nprocs: int, procs) -> list:
    deadline = load.deadline(240)
    while not all((tmp_path / f"out{p}").exists() for p in range(nprocs)):
        assert time.monotonic() < deadline, "workers did not finish"
        assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)
    time.sleep(0.05)
    return [json.loads((tmp_path / f"out{p}").read_text()) for p in range(nprocs)]


def test_processes_racing_commit_exactly_once(tmp_path):
    root, world, nprocs = str(tmp_path / "job"), 150, 5  # three groups, then the root
    procs = _start(tmp_path, root, "finish", nprocs, world)
    for p in procs:
        assert p.wait(timeout=240) == 0
    won = [r for ranks in _results(tmp_path, nprocs, procs) for r in ranks]
    assert len(won) == 1
    store = open_store(root)
    commit = catalog.read_commit(store, 5)
    assert commit["world_size"] == world and commit["bytes"] == sum(range(world)) and commit["objects"] == world
    assert donetree.count_done(store, 5, "att") == world
    assert catalog.latest_step(store) == 5


def test_a_process_killed_before_its_last_rank_leaves_no_commit(tmp_path):
    root, world, nprocs = str(tmp_path / "job"), 150, 5
    procs = _start(tmp_path, root, "finish", nprocs, world, hold=2)
    results = _results(tmp_path, nprocs, procs)
    os.kill(procs[2].pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=240)
    assert results == [[]] * nprocs
    store = open_store(root)
    assert catalog.read_commit(store, 5) is None
    assert donetree.count_done(store, 5, "att") == world - 1
    assert catalog.latest_step(store) is None
    assert [i.committed for i in catalog.list_checkpoints(store)] == [False]


def test_processes_committing_steps_at_once_keep_the_chain_increasing(tmp_path):
    root, per_proc, nprocs = str(tmp_path / "job"), 12, 4
    procs = _start(tmp_path, root, "steps", nprocs, per_proc)
    for p in procs:
        assert p.wait(timeout=240) == 0
    store = open_store(root)
    chain, cur = [], json.loads(store.get(latest.FIRST))
    while True:
        chain.append(cur)
        try:
            cur = json.loads(store.get(latest.link_key(cur)))
        except KeyError:
            break
    total = per_proc * nprocs
    assert chain == sorted(set(chain)) and chain[-1] == total
    assert latest.latest_from_chain(store) == (True, total)
    assert catalog.latest_step(store) == total
    assert all(store.exists(f"{mf.step_dir(s)}/{mf.COMMIT}") for s in range(1, total + 1))
