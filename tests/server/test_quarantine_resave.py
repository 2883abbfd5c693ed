"""Through a real ``ckptd serve``: a step quarantined right after the daemon committed it can be
saved again at once (issue 28 item 7: the daemon's commit cache refused it for a minute), and a
hand-off of a step far past the root's newest commit is refused (issue 26 part 2: retention
would count it as the newest and delete every real step)."""

from __future__ import annotations

import pytest
import torch

from ckptd.errors import CheckpointError
from tests.faults.common import chunk_files, cli, flip_byte
from tests.server.daemon import Daemon
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}


def test_a_quarantined_step_saves_again_through_the_same_daemon(tmp_path):
    root = str(tmp_path / "job")
    with Daemon([root], tmp_path / "staging", tmp_path / "d.log") as d:
        with Checkpointer(root, daemon=d.socket_url) as ck:
            for step in (1, 2, 3):
                ck.save(step, state(step)).result()
        flip_byte(chunk_files(root, 3)[0])
        out = cli("quarantine", root, "--step", "3", "--reason", "crc32c mismatch")
        assert out.returncode == 0, out.stderr
        out = cli("verify", root, "--step", "3")
        assert out.returncode != 0 and "no such checkpoint" in out.stderr
        with Checkpointer(root, daemon=d.socket_url) as ck:
            got = state(0)
            assert ck.restore(got) == 2
            ck.save(3, state(33)).result()  # refused "already committed" before the fix
            again = state(0)
            assert ck.restore(again) == 3
            assert torch.equal(again["w"], state(33)["w"])
        assert "already committed" not in d.logs()


def test_a_hand_off_far_past_the_newest_commit_is_refused(tmp_path):
    root = str(tmp_path / "job")
    with Daemon([root], tmp_path / "staging", tmp_path / "d.log") as d:
        # the trainer's own bound off: the daemon's is what is tested
        with Checkpointer(root, daemon=d.socket_url, max_step_jump=None) as ck:
            ck.save(1, state(1)).result()
            with pytest.raises(CheckpointError, match=r"max_step_jump=1000000"):
                ck.save(9_999_999_999, state(2)).result()
        with Checkpointer(root, daemon=d.socket_url, max_step_jump=None) as ck:
            ck.save(2, state(2)).result()  # within the bound
            assert ck.latest_step() == 2


def test_a_quarantined_step_saves_again_through_the_same_checkpointer(tmp_path):
    """The same in-process cache: a Checkpointer that committed step 3 refused to save it again
    after it was quarantined and the job went back to step 2."""
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step)).result()
        flip_byte(chunk_files(root, 3)[0])
        assert cli("quarantine", root, "--step", "3", "--reason", "crc32c mismatch").returncode == 0
        got = state(0)
        assert ck.restore(got, fallback=True) == 2
        ck.save(3, state(33)).result()  # refused "already committed" before the fix
        again = state(0)
        assert ck.restore(again) == 3 and torch.equal(again["w"], state(33)["w"])
