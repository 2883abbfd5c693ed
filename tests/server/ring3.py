"""A ring of 3 node daemons as the docs run them (token file, own sockets, the ring's peer key)
and a 3-rank gloo job on it (one rank per node, ``tests.faults.tier_scenarios``): saves steps
1..``LAST`` persisting every ``EVERY``-th, waits for its newest step's redundancy, restores.
Shared by ``tests/server/test_erasure_tier.py`` and ``benchmarks.erasure --daemons``."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlencode

from tests import load
from tests.distributed import launch
from tests.server.daemon import Daemon, kill_all, node, wait_for

__all__ = ["EVERY", "LAST", "RANKS", "TOKEN", "held", "restore", "ring", "save"]

SCENARIOS = "tests.faults.tier_scenarios"
TOKEN = "ring3-test-token-0123456789"
LAST, EVERY, RANKS = 4, 3, 3  # steps 1, 2 and 4 memory-only, step 3 in the job root


def ring(work: Path, **env: str) -> tuple[str, list[Daemon]]:
    """Daemons a, b, c with ``env`` (``CKPTD_EC="2+1"``, or ``CKPTD_REPLICAS="1"``)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "token").write_text(TOKEN)
    os.chmod(work / "token", 0o600)
    root = f"file://{work / 'job'}"
    ports = [launch.free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    return root, [node(work, n, root, p, urls, **env) for n, p in zip("abc", ports, strict=True)]


def held(d: Daemon, root: str, step: int) -> dict[str, int]:
    """Bytes ``d`` holds of memory-only ``step``: its own parts, others' parts (replicas or
    rebuilt), parity blocks (each with the number of shares folded in: ``slots``)."""
    status, body = d.get(f"/v1/tiers?{urlencode({'root': root})}", TOKEN)
    assert status == 200, body
    parts = [p for p in body["memory_only"] if p["step"] == step]  # type: ignore[index]
    parity = [p for p in body.get("parity", []) if p["step"] == step]  # type: ignore[union-attr]
    return {
        "own": sum(p["bytes"] for p in parts if p["source"] == "self"),
        "others": sum(p["bytes"] for p in parts if p["source"] != "self"),
        "parity": sum(p["bytes"] for p in parity),
        "parity_slots": min((p["slots"] for p in parity), default=0),
    }


def save(work: Path, root: str, daemons: list[Daemon], ready) -> Path:
    """Run the job to step ``LAST``; wait until ``ready(daemon)`` holds on every daemon (the newest
    step's parity sealed, or its replicas)."""
    out = work / "out"
    args = {"daemons": [d.socket_url for d in daemons], "root": root, "out": str(out), "steps": LAST}
    procs = launch.spawn(RANKS, "save_steps", args | {"persist_every": EVERY}, out, {"CKPTD_TOKEN": TOKEN}, SCENARIOS)
    try:
        launch.wait(procs, out, "save_steps", timeout=load.scaled(300))
    finally:
        kill_all(procs)
    wait_for(lambda: all(ready(d) for d in daemons), f"step {LAST}'s redundancy on every daemon", 60)
    return out


def restore(out: Path, via: Daemon, root: str, name: str, world: int = 2) -> list[dict]:
    """Restore at ``world`` ranks through ``via``; every rank's result, none differing from its
    step's reference (bitwise, the data position included)."""
    rargs = {"daemon": via.socket_url, "root": root, "refs": str(out), "saved_world": RANKS}
    rout = out.parent / name
    procs = launch.spawn(world, "restore_step", rargs, rout, {"CKPTD_TOKEN": TOKEN}, SCENARIOS)
    try:
        got = launch.wait(procs, rout, "restore_step", timeout=load.scaled(300))
    finally:
        kill_all(procs)
    assert all(r["mismatches"] == [] for r in got), got
    return got
