"""Reaching the daemon the way the docs print it (``ckptd.daemon_conn``): a daemon with a token
file on its default socket (``CKPTD_SOCKET``, no ``--trust-tcp``), a trainer that names no
address (``daemon=True``). Every call goes through the socket: save, restore from the memory
tier, a memory-only step, the fence, ``ckptd ls --daemon unix://...`` (and ``http+unix://``). A wrong or unreachable
address is one error naming it and what to set; a second daemon cannot take a live daemon's
socket, and a socket folder another user owns is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import torch

from ckptd.errors import CheckpointError
from tests.server.daemon import ROOT, Daemon
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(600)

TOKEN = "socket-test-token-0123456789abcdef"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}


def _ls(root: str, daemon: str) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", "ls", root, "--daemon", daemon, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "not listed" not in r.stderr, r.stderr
    return {row["step"]: row for row in json.loads(r.stdout)}


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    """A daemon as the README runs it: a token file, its default socket, no --trust-tcp; the
    trainer's environment names the token file only."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(token))
    sock = os.environ["CKPTD_SOCKET"]  # this test's default socket (tests/conftest.py), for both sides
    d = Daemon([str(tmp_path / "jobs")], None, tmp_path / "d.log", token_file=token, trust_tcp=False, CKPTD_SOCKET=sock)
    assert not Path(sock).parent.exists()  # the daemon makes the folder
    with d:
        yield d


def test_every_call_goes_through_the_default_socket(tmp_path, daemon, monkeypatch):
    root = f"file://{tmp_path / 'jobs' / 'run'}"
    with Checkpointer(root, daemon=True, persist_every=2) as ck:
        assert ck.daemon == daemon.socket_url
        for step in (1, 2, 3):
            ck.save(step, _state(step)).result(timeout=120)
    assert sorted(p.name for p in (tmp_path / "jobs" / "run").iterdir() if p.name.startswith("step_")) == [
        "step_0000000002"
    ]
    rows = _ls(root, daemon.socket_url)  # the CLI over the socket: step 3 in memory only
    assert rows[3]["memory_only"] and rows[3]["tiers"], rows
    assert rows[2]["committed"], rows

    # The same socket in its other spelling, named by CKPTD_DAEMON, for the restores and the fence.
    monkeypatch.setenv("CKPTD_DAEMON", "http+unix://" + quote(str(daemon.socket), safe=""))
    with Checkpointer(root, daemon=True) as ck:
        state = _state(99)
        assert ck.restore(state) == 3  # the memory-only step, from the daemon's memory
        assert ck.last_restore_tiers["root"] == 0 and ck.last_restore_tiers["local"] > 0, ck.last_restore_tiers
        assert all(torch.equal(state[k], v) for k, v in _state(3).items())

        state = _state(99)
        assert ck.restore(state, step=2) == 2  # the persisted step, its shards from the hot copy
        assert all(torch.equal(state[k], v) for k, v in _state(2).items())
        assert ck.last_restore_tiers["root"] == 0, ck.last_restore_tiers
    # Restoring step 2 fenced step 3 away: the daemon (asked over its socket) no longer holds it.
    rows = _ls(root, os.environ["CKPTD_DAEMON"])
    assert 3 not in rows and rows[2]["committed"], rows


def test_a_wrong_or_unreachable_address_is_one_clear_error(tmp_path, monkeypatch):
    root = str(tmp_path / "jobs")
    gone = tmp_path / "nobody" / "ckptd.sock"
    monkeypatch.setenv("CKPTD_SOCKET", str(gone))
    with pytest.raises(CheckpointError) as e:
        Checkpointer(root, daemon=True)
    assert f"unix://{gone}" in str(e.value) and "CKPTD_DAEMON" in str(e.value) and "CKPTD_SOCKET" in str(e.value)
    monkeypatch.setenv("CKPTD_DAEMON", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(CheckpointError) as e:
        Checkpointer(root, daemon=True)
    assert "http://127.0.0.1:9" in str(e.value) and "CKPTD_DAEMON" in str(e.value)
    for bad in ("ftp://host/x", "unix://relative/ckptd.sock", "127.0.0.1:8470"):
        with pytest.raises(CheckpointError) as e:
            Checkpointer(root, daemon=bad)
        assert repr(bad) in str(e.value), e.value


def test_a_live_daemons_socket_is_not_taken_and_a_dead_ones_is(tmp_path, daemon):
    same = os.environ["CKPTD_SOCKET"]  # the same default socket
    second = Daemon(
        [str(tmp_path / "other")], None, tmp_path / "d2.log", token_file=tmp_path / "token", CKPTD_SOCKET=same
    )
    second.trust_tcp = False
    with pytest.raises(AssertionError, match="exited with 2"):
        second.start(timeout=120)
    assert "another ckptd serve listens on" in second.logs() and "Traceback" not in second.logs()
    assert daemon.healthy() and daemon.socket.is_socket()
    daemon.kill()  # SIGKILL: its socket file stays behind
    assert daemon.socket.is_socket()
    second.start(timeout=120)  # a dead daemon's socket of this user is replaced
    try:
        with Checkpointer(str(tmp_path / "other" / "run"), daemon=True) as ck:
            ck.save(1, _state(1)).result(timeout=120)
    finally:
        second.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_a_socket_folder_of_another_user_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    squat = tmp_path / "squat"
    squat.mkdir(mode=0o755)
    os.chown(squat, 65534, 65534)  # pre-created by another user (nobody)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for sock in (squat / "ckptd.sock", link / "ckptd.sock"):
        d = Daemon([str(tmp_path / "jobs")], None, tmp_path / "d.log", token_file=token, CKPTD_SOCKET=str(sock))
        with pytest.raises(AssertionError, match="exited with 2"):
            d.start(timeout=120)
        assert str(sock.parent) in d.logs() and "Traceback" not in d.logs(), d.logs()
        assert not sock.exists()
        d.log_path.unlink()


def test_the_daemon_makes_the_socket_folder_as_private_as_its_staging(tmp_path):
    """A socket folder the daemon makes is its own: 0700, or 0710 and the trainers' group with
    --staging-group (only its members reach the socket)."""
    import grp

    token = tmp_path / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    group = grp.getgrgid(os.getgid()).gr_name
    for name, env, mode in (("plain", {}, 0o700), ("group", {"CKPTD_STAGING_GROUP": group}, 0o710)):
        sock = tmp_path / name / "ckptd.sock"
        d = Daemon([str(tmp_path / "jobs")], None, tmp_path / f"{name}.log", token_file=token, trust_tcp=False)
        d.env.update(CKPTD_SOCKET=str(sock), CKPTD_ISOLATE_TENANTS="0", **env)
        with d:
            st = os.stat(sock.parent)
            assert (st.st_mode & 0o7777, st.st_uid) == (mode, os.geteuid()) and st.st_gid == os.getgid()
            assert sock.is_socket() and os.stat(sock).st_mode & 0o777 == 0o666
