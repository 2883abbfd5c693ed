"""The spill folder (``ckptd serve --spill-dir``, ``ckptd.server.spill``): a restarted daemon
serves its memory-only parts again. Two node daemons a and b as the docs run them (a token,
each node's own socket, the ring's peer key, no --trust-tcp), each with its spill folder; a
2-rank job (rank 0 on a, rank 1 on b) saves steps 1..3 persisting every 2nd, so step 3 lives in
the daemons' memory only (a: rank 0's part and its replica of rank 1's; b: the reverse).

- a is SIGKILLed and restarted on the same spill folder, then b is SIGKILLed: the restore still
  finds step 3, bitwise, 0 bytes from the job root (without the spill folder a restarted a
  holds nothing, b is gone, and the job falls back to the persisted step 2).
- A spill file whose bytes were flipped (a's replica of rank 1's part of step 3), and a symbolic
  link planted under a spill file's name, are not adopted (logged once each, removed): the
  restore falls back to the persisted step 2, bitwise, never step 3 with wrong bytes.
- A spill folder that is a link, another user's, or writable by others: the daemon refuses to
  start (exit 2, one line).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.server.spill import MAGIC
from tests.distributed import launch
from tests.distributed.scenarios import BATCH
from tests.server.daemon import ROOT, Daemon, node, wait_for

pytestmark = pytest.mark.timeout(900)

SCENARIOS = "tests.server.memstep_scenarios"
TOKEN = "spill-test-token-0123456789"
LAST, EVERY = 3, 2  # step 3 memory-only, step 2 persisted


def _parts(d: Daemon, root: str) -> list[dict]:
    status, body = d.get(f"/v1/tiers?root={root}", TOKEN)
    assert status == 200, body
    return body["memory_only"]  # type: ignore[index]


def _spilled(d: Daemon, root: str, step: int, want: dict[int, str]) -> bool:
    """Whether ``d`` holds rank -> source ``want``'s parts of ``step``, each written to its spill folder."""
    got = {(p["rank"], p["source"]) for p in _parts(d, root) if p["step"] == step and p.get("spilled")}
    return set(want.items()) <= got


def _ring_saved(tmp_path: Path):
    """Nodes a and b with spill folders; the job's steps 1..3 saved; a's parts of step 3 (its
    own, and its replica of b's) spilled. Returns (root, a, b, urls, out)."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    pa, pb = launch.free_port(), launch.free_port()
    urls = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    for n in "ab":
        (tmp_path / f"spill-{n}").mkdir(mode=0o700)
    a = node(tmp_path, "a", root, pa, urls, trust_tcp=False, CKPTD_SPILL_DIR=str(tmp_path / "spill-a"))
    b = node(tmp_path, "b", root, pb, urls, trust_tcp=False, CKPTD_SPILL_DIR=str(tmp_path / "spill-b"))
    out = tmp_path / "out"
    args = {"daemons": [a.socket_url, b.socket_url], "root": root, "last": LAST, "persist_every": EVERY}
    procs = launch.spawn(2, "save_memory", args | {"hang": False}, out, {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
    launch.wait(procs, out, "save_memory", timeout=600)
    wait_for(lambda: _spilled(a, root, LAST, {0: "self", 1: urls[1]}), "a's parts of step 3 spilled", 120)
    return root, a, b, urls, out


def _header(path: Path) -> tuple:
    """(step, kind, source, where its objects' bytes begin) of a spill file (``ckptd.server.spill``),
    or () for another file."""
    raw = path.read_bytes()
    if not raw.startswith(MAGIC):
        return ()
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    head = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    return head["step"], head["kind"], head["source"], len(MAGIC) + 4 + n


def _restore(a: Daemon, root: str, out: Path, step: int) -> dict:
    args = {"daemon": a.socket_url, "root": root, "ref": str(out / f"ref_step{step}.pt")}
    procs = launch.spawn(2, "restore_position", args, out / "r", {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
    res = launch.wait(procs, out / "r", "restore_position", timeout=600)
    assert all((r["step"], r["mismatches"], r["position"]) == (step, [], step * BATCH * 2) for r in res), res
    return {k: sum(r["tiers"][k] for r in res) for k in ("local", "peer", "root")}


def test_a_restarted_daemon_serves_its_spilled_parts(tmp_path):
    root, a, b, urls, out = _ring_saved(tmp_path)
    try:
        a.kill()
        a.start(port=a.port)  # the same staging and spill folders
        assert _spilled(a, root, LAST, {0: "self", 1: urls[1]}), _parts(a, root)
        b.kill()  # now the only copies of step 3 are the ones a re-adopted
        got = _restore(a, root, out, LAST)
        assert got["root"] == 0 and got["local"] > 0, got
        assert a.metric("ckptd_tier_spill_refused_total", TOKEN) == 0
    finally:
        a.kill()
        b.kill()


def test_a_tampered_spill_file_is_not_adopted(tmp_path):
    root, a, b, urls, out = _ring_saved(tmp_path)
    try:
        a.kill()
        spill = tmp_path / "spill-a"
        (tampered,) = [p for p in spill.iterdir() if _header(p)[:3] == (LAST, "memory_only", urls[1])]
        data = bytearray(tampered.read_bytes())  # a's replica of rank 1's part of step 3
        begin = _header(tampered)[3]
        data[(begin + len(data)) // 2] ^= 0xFF  # a byte flipped inside its objects
        tampered.write_bytes(bytes(data))
        planted = spill / ("0" * 32 + ".spill")
        planted.symlink_to("/etc/passwd")
        a.start(port=a.port)
        logs = a.logs()
        assert logs.count(f"{tampered.name} not adopted") == 1, logs
        assert logs.count(f"{planted.name} not adopted") == 1, logs
        assert not tampered.exists() and not planted.is_symlink()
        assert a.metric("ckptd_tier_spill_refused_total", TOKEN) == 2
        b.kill()
        # Step 3 lacks a part everywhere: the restore takes the persisted step 2, bitwise (its
        # bytes from a's hot copies of it, adopted from the spill folder too, or the root).
        _restore(a, root, out, EVERY)
    finally:
        a.kill()
        b.kill()


@pytest.mark.parametrize("bad", ["link", "group-writable", "other-user"])
def test_an_unsafe_spill_folder_stops_the_daemon(tmp_path, bad):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    spill = tmp_path / "spill"
    if bad == "link":
        spill.symlink_to(real)
    else:
        spill.mkdir(mode=0o700)
        if bad == "group-writable":
            os.chmod(spill, 0o770)
        else:
            os.chown(spill, 1002, 1002)  # ckptd-alice
    args = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", f"file://{tmp_path / 'job'}", "--port", "0"]
    args += ["--staging-dir", str(tmp_path / "staging"), "--token-file", str(tmp_path / "token")]
    args += ["--spill-dir", str(spill)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTD_SOCKET": str(tmp_path / "ckptd.sock")}
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [line for line in p.stderr.splitlines() if "spill folder" in line]
    assert len(lines) == 1 and str(spill) in lines[0], p.stderr
