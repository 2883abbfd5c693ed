"""The erasure-coded memory tier (``ckptd serve --ec k+m``, ``ckptd.server.parity``) with real
daemons as the docs run them (token file, own sockets, the ring's peer key): 3 daemons with
``--ec 2+1``, a 3-rank gloo job (one rank per node) saving every step, persisting every 3rd
(steps 1, 2 and 4 memory-only, step 3 in the job root).

- One daemon is SIGKILLed after step 4's parity is sealed on its holders: a restore at 2 ranks
  gets step 4 bitwise, with 0 bytes from the job root: rank 0's daemon rebuilt the lost part
  from the group's parity and the survivor's data blocks (nothing but what is missing).
- Two daemons are SIGKILLed (more than m = 1): nothing can be rebuilt, and the restore falls
  back to the persisted step 3, bitwise, never to other weights.
- ``--ec`` with ``--replicas K > 0``, or a malformed code, is one clear usage error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd import manifest as mf
from tests import load
from tests.server.daemon import ROOT, Daemon, peer_key_file, tier_totals
from tests.server.ring3 import EVERY, LAST, TOKEN, held, restore, ring, save

pytestmark = pytest.mark.timeout(900)


def _ring(tmp_path: Path) -> tuple[str, list[Daemon]]:
    return ring(tmp_path, CKPTD_EC="2+1")


def _save(tmp_path: Path, root: str, daemons: list[Daemon]) -> Path:
    # Step 4's parity sealed on every daemon: each holds one block of one stripe, both shares in.
    out = save(tmp_path, root, daemons, lambda d: held(d, root, LAST)["parity_slots"] == 2)
    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir() if p.name.startswith("step_")) == [mf.step_dir(EVERY)]
    return out


def test_one_lost_daemon_is_rebuilt_from_parity_and_restored_at_fewer_ranks(tmp_path):
    root, daemons = _ring(tmp_path)
    a, _, c = daemons
    try:
        out = _save(tmp_path, root, daemons)
        # No node holds another's part whole: its own parts and parity only.
        status, body = a.get(f"/v1/tiers?root={root}&keys=true", TOKEN)
        assert {p["source"] for p in body["memory_only"]} == {"self"}, body  # type: ignore[index]
        c.kill()
        got = restore(out, a, root, "restore2")
        assert {r["step"] for r in got} == {LAST}, got
        tiers = tier_totals(got)
        assert tiers["root"] == 0 and tiers["local"] + tiers["peer"] > 0, tiers
        assert "rebuilt" in a.logs()
    finally:
        for d in daemons:
            d.kill()


def test_more_losses_than_m_fall_back_to_the_persisted_step(tmp_path):
    root, daemons = _ring(tmp_path)
    a, b, c = daemons
    try:
        out = _save(tmp_path, root, daemons)
        b.kill()
        c.kill()
        got = restore(out, a, root, "restore2")
        assert {r["step"] for r in got} == {EVERY}, got
        assert tier_totals(got)["root"] > 0
        assert "at most 1 can be rebuilt" in a.logs()
    finally:
        for d in daemons:
            d.kill()


@pytest.mark.parametrize(
    "flags,why",
    [
        (["--ec", "2+1", "--replicas", "1"], "--ec 2+1 and --replicas 1 exclude each other"),
        (["--ec", "2"], "--ec must be k+m"),
        (["--ec", "4+2"], "must name this daemon (--advertise) and be a multiple of 6 daemons"),
    ],
)
def test_ec_settings_that_do_not_go_together_are_one_usage_error(tmp_path, flags, why):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    ring = "http://127.0.0.1:9101,http://127.0.0.1:9102,http://127.0.0.1:9103"
    cmd = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", str(tmp_path / "job"), "--token-file"]
    cmd += [str(tmp_path / "token"), "--peer-key-file", str(peer_key_file(tmp_path)), "--port", "0"]
    cmd += ["--socket", str(tmp_path / "d.sock"), "--staging-dir", str(tmp_path / "staging")]
    cmd += ["--peers", ring, "--advertise", "http://127.0.0.1:9101", *flags]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=load.scaled(60), env=env, cwd=str(ROOT))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert why in p.stderr and "Traceback" not in p.stderr, p.stderr
