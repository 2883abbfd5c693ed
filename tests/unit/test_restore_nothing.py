"""A restore that finds no committed step says so: one WARNING naming the root (a mistyped root
URI would otherwise start the job from scratch without a word), and ``require=True`` raises for
jobs that must resume (``Checkpointer.restore``, ``CheckpointHook.resume``)."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptd.errors import CheckpointNotFoundError
from trainer_hooks import Checkpointer
from trainer_hooks.hook import CheckpointHook


def _state():
    return {"model": torch.nn.Linear(3, 2)}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("fallback", [False, True])
def test_restore_of_an_empty_root_warns_once_naming_the_root(tmp_path, caplog, fallback):
    root = str(tmp_path / "typo")
    with Checkpointer(root) as ck, caplog.at_level(logging.WARNING, logger="ckptd"):
        assert ck.restore(_state(), fallback=fallback) is None
    got = _warnings(caplog)
    assert len(got) == 1, got
    assert root in got[0] and "no committed checkpoint" in got[0]


@pytest.mark.parametrize("fallback", [False, True])
def test_require_raises_naming_the_root(tmp_path, caplog, fallback):
    root = str(tmp_path / "typo")
    state = _state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with (
        Checkpointer(root) as ck,
        pytest.raises(CheckpointNotFoundError, match="no committed checkpoint to restore") as e,
    ):
        ck.restore(state, require=True, fallback=fallback)
    assert root in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())


def test_require_restores_when_there_is_a_step_and_is_silent(tmp_path, caplog):
    root = str(tmp_path / "job")
    state = _state()
    with Checkpointer(root) as ck:
        ck.save(4, state).result()
    with Checkpointer(root) as ck, caplog.at_level(logging.WARNING, logger="ckptd"):
        assert ck.restore(_state(), require=True) == 4
    assert _warnings(caplog) == []


def test_hook_resume_passes_require(tmp_path, caplog):
    root = str(tmp_path / "typo")
    with Checkpointer(root) as ck:
        hook = CheckpointHook(ck, _state(), every_n_steps=None, save_on_signal=False)
        try:
            with pytest.raises(CheckpointNotFoundError, match=str(tmp_path)):
                hook.resume(require=True)
            with caplog.at_level(logging.WARNING, logger="ckptd"):
                assert hook.resume() == 0
            assert len(_warnings(caplog)) == 1
        finally:
            hook.close()
