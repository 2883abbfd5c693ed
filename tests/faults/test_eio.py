"""An I/O error (EIO) in the middle of a save: the save's future fails with one clear error,
committed steps stay whole, the job saves again, gc leaves nothing of the failed step.

EIO comes from ``tests.doubles.faults.FailingStore``, a wrapper: this machine has no real
mechanism to make a filesystem return EIO on demand (no device-mapper ``error`` target), unlike
ENOSPC, which ``test_campaign`` gets from a real, full tmpfs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.errors import CheckpointError
from tests.doubles.faults import FailingStore
from tests.faults.common import STEP_DIR, all_files, cli
from tests.faults.workers import campaign_state, empty_state, same_state
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)


def test_eio_mid_save_fails_its_future_once_and_loses_nothing(tmp_path):
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, campaign_state(1)).result()
        failing = FailingStore(ck.store, lambda key: key.startswith(STEP_DIR.format(2)) and "/arrays/w/a/c" in key)
        real = ck._sink.store
        ck._sink.store = failing  # the writer's store: its puts of step 2's big shard get EIO
        fut = ck.save(2, campaign_state(2))
        with pytest.raises(CheckpointError, match="Input/output error") as err:
            fut.result(timeout=240)
        assert "\n" not in str(err.value) and failing.failed >= 1
        ck._sink.store = real
        state = empty_state()
        assert ck.restore(state) == 1 and same_state(state, campaign_state(1))
        ck.save(3, campaign_state(3)).result()  # the job goes on
    out = cli("gc", root, "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kept"] == [3]
    assert not (Path(root) / STEP_DIR.format(2)).exists()
    assert [f for f in all_files(root) if ".tmp." in f] == []
