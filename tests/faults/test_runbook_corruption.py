"""The corruption runbook of ``docs/operations.md`` ("A checkpoint is corrupt"), followed word for
word (issue 28 item 6): find the bad steps (``verify --all``, ``ls``), resume the job from the
newest good step (``CheckpointHook(..., fallback=True)``), then retire the bad steps
(``quarantine``). The job keeps training throughout: before the fix it died when it reached a bad
step that was not quarantined yet ("step 5 is already committed; refusing to overwrite")."""

from __future__ import annotations

import json
import logging

import pytest

from tests.faults.common import chunk_files, cli, flip_byte, make_state, same, values
from trainer_hooks import Checkpointer, CheckpointHook

pytestmark = pytest.mark.timeout(300)


def train(hook: CheckpointHook, state: dict, steps: range, history: dict) -> None:
    """A stand-in for an optimizer step: every step changes the state; ``history`` keeps each
    step's values, to compare restores against."""
    for step in steps:
        state["extra"]["emb"] += 1.0
        history[step] = values(state)
        hook.after_step(step)


def test_the_corruption_runbook_word_for_word(tmp_path, caplog):
    root = str(tmp_path / "job")
    history: dict[int, dict] = {}
    # the job before the incident: saves after steps 1, 3, 5, 7
    with Checkpointer(root) as ck:
        state = make_state(seed=1)
        hook = CheckpointHook(ck, state, every_n_steps=2, save_on_signal=False)
        assert hook.resume() == 0
        train(hook, state, range(8), history)
        hook.close()
    flip_byte(chunk_files(root, 5)[0])
    flip_byte(chunk_files(root, 7)[0])

    # 1. Find out which steps are bad, and record it
    out = cli("verify", root, "--all")
    assert out.returncode == 1
    out = cli("ls", root, "--json")
    assert out.returncode == 0, out.stderr
    assert {r["step"]: r["verified"] for r in json.loads(out.stdout)} == {1: "ok", 3: "ok", 5: "bad", 7: "bad"}

    # 2. Resume the job from the newest good step (the loop hook, fallback=True)
    with Checkpointer(root) as ck:
        state = make_state(seed=99)
        hook = CheckpointHook(ck, state, every_n_steps=2, fallback=True, save_on_signal=False)
        start = hook.resume()
        assert start == 4 and same(values(state), history[3])
        # the job reaches bad step 5 before anyone quarantined it: it goes on, says what to run
        with caplog.at_level(logging.WARNING, logger="ckptd.hook"):
            train(hook, state, range(start, 6), history)
            ck.wait()
        assert any(
            "not saving step 5" in r.getMessage() and "ckptd quarantine" in r.getMessage() for r in caplog.records
        )

        # 3. Retire the bad steps (while the job runs)
        for bad in (5, 7):
            out = cli("quarantine", root, "--step", bad, "--reason", "crc32c mismatch")
            assert out.returncode == 0, out.stderr
        out = cli("quarantine", root, "--list", "--json")
        assert out.returncode == 0 and sorted(r["step"] for r in json.loads(out.stdout)) == [5, 7]

        # the job reaches step 7, quarantined now: saved again as usual
        train(hook, state, range(6, 10), history)
        hook.close()

    out = cli("ls", root, "--json")
    assert [r["step"] for r in json.loads(out.stdout)] == [1, 3, 7, 9]
    assert cli("verify", root, "--all").returncode == 0
    with Checkpointer(root) as ck:
        for step in (7, 9):
            got = make_state(seed=98)
            assert ck.restore(got, step=step) == step
            assert same(values(got), history[step])
