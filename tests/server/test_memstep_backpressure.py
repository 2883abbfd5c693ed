"""Backpressure on replication (``Tiers.backpressure``, docs/reliability.md "Memory-only steps"):
a rank's hand-off of memory-only step N waits while its daemon's own parts of an older step are
still being pushed to a peer, bounded by the save's deadline. Two real daemons on loopback (a
and b, token file and peer key, trainers on b's socket as the docs run it); node b's push of
step 1 sleeps first (``push_delay``): its replica is in flight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptd.errors import CheckpointError
from tests.distributed import launch
from tests.server.daemon import node, wait_for
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)

TOKEN = "backpressure-test-token-0123456789"
STATE = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(7)}


def _nodes(tmp_path: Path, monkeypatch, push_s: float):
    """Daemons a and b (b's push of step 1 sleeps ``push_s`` first); trainers hold the token."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    root = f"file://{tmp_path / 'job'}"
    pa, pb = launch.free_port(), launch.free_port()
    urls = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    a = node(tmp_path, "a", root, pa, urls, trust_tcp=False)
    b = node(tmp_path, "b", root, pb, urls, trust_tcp=False, push_delay=(1, push_s))
    return root, a, b


def _replica_of_step_1(a, b, root: str) -> list[dict]:
    status, body = a.get(f"/v1/tiers?root={root}", TOKEN)
    assert status == 200, body
    return [p for p in body["memory_only"] if p["step"] == 1 and p["source"] == b.url]


def test_a_hand_off_waits_until_the_previous_steps_replicas_are_sealed(tmp_path, monkeypatch):
    root, a, b = _nodes(tmp_path, monkeypatch, push_s=5.0)
    try:
        with Checkpointer(root, daemon=b.socket_url, persist_every=100) as ck:
            ck.save(1, STATE).result()
            ck.save(2, STATE).result()  # b held step 2 only once a held step 1's replica
            assert len(_replica_of_step_1(a, b, root)) == 1, b.logs()
        assert "waits for step 1's replica to " + a.url in b.logs()
        assert b.metric("ckptd_tier_backpressure_seconds_total", TOKEN) > 0
    finally:
        a.kill()
        b.kill()


def test_a_replica_still_unsealed_at_the_deadline_fails_the_save(tmp_path, monkeypatch):
    root, a, b = _nodes(tmp_path, monkeypatch, push_s=600.0)  # longer than the test
    try:
        with Checkpointer(root, daemon=b.socket_url, persist_every=100, save_timeout=8) as ck:
            ck.save(1, STATE).result()
            with pytest.raises(CheckpointError):
                ck.save(2, STATE).result()
        # The daemon's own error names the unsealed step and peer (the trainer may see its own
        # deadline first).
        why = f"step 2 waited for step 1's replica to {a.url} to be sealed until the save's deadline"
        wait_for(lambda: why in b.logs(), "the daemon's error", 60, logs=b.logs)
        assert _replica_of_step_1(a, b, root) == []
    finally:
        a.kill()
        b.kill()
