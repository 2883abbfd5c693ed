"""Fixtures the fault tests share (``tests/faults/common.py`` holds the plain helpers)."""

from __future__ import annotations

import pytest

from tests.faults.common import make_state, values
from trainer_hooks import Checkpointer


@pytest.fixture
def job(tmp_path):
    """A local job root with steps 1, 2, 3 committed from different states; their values."""
    root = str(tmp_path / "job")
    saved = {}
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            state = make_state(seed=step)
            ck.save(step, state).result()
            saved[step] = values(state)
    return root, saved
