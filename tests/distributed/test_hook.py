"""``CheckpointHook`` with real signals.

In one process: periodic saves land on the right steps, SIGTERM/SIGUSR1 save the current step,
raise ``SystemExit(0)`` and put the previous handlers back, and ``resume`` continues at the saved
step + 1. In real gloo processes (``examples/train_elastic.py`` with FSDP2, started as torchrun
would start it): SIGTERM to one rank of 2 makes both save the same step and exit 0, and a
3-rank job resumes at the next step with no sample repeated or skipped.
"""

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
import torch

from ckptd import catalog
from storage_backends import open_store
from tests import load
from tests.local_launch import spawn_ranks, wait_ranks
from trainer_hooks import Checkpointer, CheckpointError, CheckpointHook, ElasticSampler

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_elastic.py"


def committed(root: str) -> list[int]:
    store = open_store(root)
    try:
        return catalog.committed_steps(store)
    finally:
        store.close()


def small_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "sampler": ElasticSampler(40)}


def train(state: dict, hook: CheckpointHook, start: int, stop: int, signal_at: dict[int, int]) -> int:
    """Steps ``start..stop-1``; sends the signal ``signal_at[step]`` to this process before
    ``after_step(step)``. Returns the step after the last one completed."""
    it = iter(state["sampler"])
    for step in range(start, stop):
        next(it)
        state["model"].weight.data += 1.0
        if step in signal_at:
            os.kill(os.getpid(), signal_at[step])
        hook.after_step(step)
    return stop


@pytest.fixture
def guarded_handlers():
    """A harmless SIGTERM/SIGUSR1 handler while the test runs (so a hook bug cannot kill
    pytest); yields it, to check that the hook puts it back."""

    def harmless(signum, frame):
        pass

    previous = {sig: signal.signal(sig, harmless) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield harmless
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_current_step_exits_0_and_resume_continues(tmp_path, guarded_handlers, signum):
    root = str(tmp_path / "job")
    state = small_state()
    with Checkpointer(root) as ck:
        hook = CheckpointHook(ck, state, every_n_steps=3)
        assert hook.resume() == 0
        assert signal.getsignal(signal.SIGTERM) is not guarded_handlers
        with pytest.raises(SystemExit) as stop:
            train(state, hook, 0, 20, {7: signum})
        assert stop.value.code == 0
        assert hook.signalled == signum and hook.last_saved == 7
        # handlers are back; the signal's save is committed when SystemExit is raised
        assert signal.getsignal(signal.SIGTERM) is guarded_handlers
        assert signal.getsignal(signal.SIGUSR1) is guarded_handlers
        assert committed(root) == [2, 5, 7]
    saved_weight = state["model"].weight.detach().clone()

    state2 = small_state(seed=1)
    with Checkpointer(root) as ck:
        hook2 = CheckpointHook(ck, state2, every_n_steps=3)
        assert hook2.resume() == 8
        assert torch.equal(state2["model"].weight, saved_weight)
        assert state2["sampler"].position == 8  # one sample per step, 8 steps done
        assert train(state2, hook2, 8, 12, {}) == 12
        hook2.close()
    assert committed(root) == [2, 5, 7, 8, 11]
    assert signal.getsignal(signal.SIGTERM) is guarded_handlers


@pytest.mark.timeout(60)
def test_signal_on_a_periodic_step_saves_it_once(tmp_path, guarded_handlers):
    root = str(tmp_path / "job")
    state = small_state()
    with Checkpointer(root) as ck:
        hook = CheckpointHook(ck, state, every_n_steps=2)
        hook.resume()
        with pytest.raises(SystemExit):
            train(state, hook, 0, 10, {5: signal.SIGTERM})
    assert committed(root) == [1, 3, 5]


@pytest.mark.timeout(60)
def test_without_signal_handling_and_bad_interval(tmp_path, guarded_handlers):
    state = small_state()
    with Checkpointer(str(tmp_path / "job")) as ck:
        with pytest.raises(ValueError, match="every_n_steps"):
            CheckpointHook(ck, state, every_n_steps=0)
        hook = CheckpointHook(ck, state, every_n_steps=None, save_on_signal=False)
        assert signal.getsignal(signal.SIGTERM) is guarded_handlers
        assert train(state, hook, 0, 5, {2: signal.SIGTERM}) == 5  # the signal is not its business
        hook.close()
        assert ck.latest_step() is None


@pytest.mark.timeout(60)
def test_failed_save_on_signal_raises_and_restores_handlers(tmp_path, guarded_handlers):
    state = small_state()
    with Checkpointer(str(tmp_path / "job")) as ck:
        hook = CheckpointHook(ck, state, every_n_steps=None)

        def failing_put(key, data):  # an injected fault: the disk is full
            raise OSError("no space left on device")

        ck.store.put = failing_put
        with pytest.raises(CheckpointError):
            train(state, hook, 0, 5, {1: signal.SIGTERM})
        assert signal.getsignal(signal.SIGTERM) is guarded_handlers
        assert hook.last_saved is None


@pytest.mark.timeout(60)
def test_close_puts_back_default_when_previous_handler_was_not_python(tmp_path, guarded_handlers, monkeypatch):
    real = signal.signal

    def as_if_installed_from_c(sig, handler):  # signal.signal returns None for such handlers
        real(sig, handler)
        return None

    with Checkpointer(str(tmp_path / "job")) as ck:
        monkeypatch.setattr(signal, "signal", as_if_installed_from_c)
        hook = CheckpointHook(ck, small_state())
        monkeypatch.undo()
        hook.close()  # used to raise TypeError from signal.signal(sig, None)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


# ------------------------------------------------------------------ real processes (gloo, FSDP2)

# a tiny model and 30 steps of 12 samples: the test is about the protocol, not the training
TRAIN_ARGS = ["--samples", "360", "--global-batch", "12", "--seq-len", "16", "--dim", "32", "--layers", "1"]


def spawn(world: int, args: list[str], log_dir: Path) -> list[subprocess.Popen]:
    argv = [sys.executable, str(TRAIN), *args, "--log-dir", str(log_dir)]
    return spawn_ranks(world, argv, lambda rank: log_dir / f"rank{rank}.out", cwd=ROOT)


def records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(log_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


def outputs(log_dir: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(log_dir.glob("rank*.out")))


def wait_all(procs: list[subprocess.Popen], log_dir: Path, timeout: float = 180) -> list[int]:
    try:
        return wait_ranks(procs, timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks did not finish\n{outputs(log_dir)}") from None


def wait_for_step(log_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    log0 = log_dir / "rank0.jsonl"
    deadline = load.deadline(timeout)
    while True:
        if log0.exists() and any(
            r["event"] == "step" and r["step"] >= step for r in map(json.loads, log0.read_text().splitlines())
        ):
            return
        assert all(p.poll() is None for p in procs), outputs(log_dir)
        assert time.monotonic() < deadline, f"step {step} never reached\n{outputs(log_dir)}"
        time.sleep(0.05)


def trained(recs: list[dict]) -> dict[int, dict[int, list[int]]]:
    """step -> rank -> sample indices."""
    out: dict[int, dict[int, list[int]]] = collections.defaultdict(dict)
    for r in recs:
        if r["event"] == "step":
            assert r["rank"] not in out[r["step"]], f"rank {r['rank']} logged step {r['step']} twice"
            out[r["step"]][r["rank"]] = r["indices"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_one_of_2_ranks_then_resume_at_3_exactly_once(tmp_path):
    root = str(tmp_path / "job")
    every = 4
    args = [*TRAIN_ARGS, "--root", root, "--every", str(every), "--step-delay", "0.05"]

    # 2 ranks; SIGTERM to rank 1 only, once training is under way
    a_dir = tmp_path / "a"
    procs = spawn(2, args, a_dir)
    wait_for_step(a_dir, 9, procs)
    procs[1].send_signal(signal.SIGTERM)
    assert wait_all(procs, a_dir) == [0, 0], outputs(a_dir)
    a = records(a_dir)
    stops = {r["rank"]: r for r in a if r["event"] == "stop"}
    assert sorted(stops) == [0, 1], outputs(a_dir)
    saved = stops[0]["step"]
    assert stops[1]["step"] == saved and saved >= 9
    assert stops[1]["signalled"] is True and stops[0]["signalled"] is False  # rank 0 followed rank 1
    a_steps = trained(a)
    assert sorted(a_steps) == list(range(saved + 1)), "a rank trained past the saved step"
    assert all(sorted(ranks) == [0, 1] for ranks in a_steps.values())
    periodic = [s for s in range(saved + 1) if (s + 1) % every == 0]
    assert committed(root) == sorted(set(periodic) | {saved})

    # 3 ranks, same command: resumes at saved + 1 and finishes the epoch
    b_dir = tmp_path / "b"
    procs = spawn(3, args, b_dir)
    assert wait_all(procs, b_dir) == [0, 0, 0], outputs(b_dir)
    b = records(b_dir)
    starts = [r for r in b if r["event"] == "start"]
    assert sorted(r["rank"] for r in starts) == [0, 1, 2]
    assert {(r["step"], r["position"], r["world"]) for r in starts} == {(saved + 1, (saved + 1) * 12, 3)}
    b_steps = trained(b)
    assert sorted(b_steps) == list(range(saved + 1, 30))
    assert all(sorted(ranks) == [0, 1, 2] and all(len(ix) == 4 for ix in ranks.values()) for ranks in b_steps.values())
    assert {r["step"] for r in b if r["event"] == "done"} == {29}
    assert committed(root)[-1] == 29  # the end of training is committed

    # every sample of the epoch exactly once, across the change of world size
    seen = collections.Counter(
        i for steps in (a_steps, b_steps) for ranks in steps.values() for ix in ranks.values() for i in ix
    )
    assert sorted(seen) == list(range(360)) and set(seen.values()) == {1}
