"""A daemon whose staging folder's path is long (its data path socket, ``ckptd-tiers.sock``,
past the 108 bytes a socket address holds) still serves its node's memory tier to a restore:
the trainer connects through a descriptor of the folder (``daemon_conn.unix_address``), as it
does to the daemon's own socket. Before, the restore skipped this node's tier ("data path:
AF_UNIX path too long"), took the persisted step from the job root and dropped the newer
memory-only steps (found by ``tests/faults/test_tier_campaign.py``, whose pytest folders are
long)."""

from __future__ import annotations

import os

import pytest

from tests.distributed import launch
from tests.server.daemon import node

pytestmark = pytest.mark.timeout(600)

SCENARIOS = "tests.server.memstep_scenarios"
TOKEN = "long-socket-test-token-0123456789"


def test_a_restore_reads_the_memory_tier_of_a_daemon_with_a_long_socket_path(tmp_path):
    home = tmp_path / ("n" * 90)
    home.mkdir()
    (home / "token").write_text(TOKEN)
    os.chmod(home / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    a = node(home, "a", root, port, [f"http://127.0.0.1:{port}"])
    try:
        assert len(os.fsencode(a.socket.with_name("ckptd-tiers.sock"))) > 108
        out = tmp_path / "out"
        args = {"daemons": [a.socket_url], "root": root, "last": 2, "persist_every": 5, "hang": False}
        launch.wait(
            launch.spawn(1, "save_memory", args, out, {"CKPTD_TOKEN": TOKEN}, SCENARIOS), out, "save_memory", 600
        )
        rargs = {"daemon": a.socket_url, "root": root, "ref": str(out / "ref_step2.pt")}
        procs = launch.spawn(1, "restore_position", rargs, out / "r1", {"CKPTD_TOKEN": TOKEN}, SCENARIOS)
        (res,) = launch.wait(procs, out / "r1", "restore_position", 600)
        assert (res["step"], res["mismatches"]) == (2, []), res
        assert res["tiers"]["root"] == 0 and res["tiers"]["local"] > 0, res["tiers"]
    finally:
        a.kill()
