"""The stall backpressure on replication adds to memory-only saves (docs/reliability.md,
"Memory-only steps": a daemon takes a rank's part of step N only once its own parts of older
steps are sealed on their peers).

    python -m benchmarks.backpressure [--size 256MiB] [--saves 8]

Two real daemons on loopback play two nodes (ring ``a,b``, one replica, the peer key and a token
file as deployed); one rank saves a state of ``--size`` bytes through daemon ``a``'s socket with
``persist_every`` larger than the run, so every step is memory-only and ``a`` pushes each part to
``b``. The saves run back to back: each one's future is waited for, then the next save starts
(the daemon's metric is read in between, a few milliseconds). The run is made twice, with fresh
daemons: as shipped, and with daemons whose hand-offs never wait for replicas
(``tests.doubles.slow_serve --no-backpressure``), the baseline. Printed per run: the time each
save was blocked by backpressure (``ckptd_tier_backpressure_seconds_total`` before and after it),
and the save-to-save time (one ``save`` call to the next), median and max over every save but
the first (which has no older step to wait for); and how many of daemon ``a``'s pushes were sealed
or had failed when the last save returned (without backpressure, retention drops parts whose
push is still running). The rank and both daemons share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from benchmarks.common import fmt_bytes, parse_size

TOKEN = "bench-backpressure-token-" + uuid.uuid4().hex
METRIC = "ckptd_tier_backpressure_seconds_total"


def _daemons(work: Path, root: str, size: int, wait: bool) -> list:
    from tests.distributed import launch
    from tests.server.daemon import node

    ports = [launch.free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    budget = str(6 * size + (256 << 20))
    return [
        node(work, name, root, port, urls, trust_tcp=False, no_backpressure=not wait, CKPTD_BUDGET=budget)
        for name, port in zip("ab", ports, strict=True)
    ]


def _state(size: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    n = size // 4 // 8
    return {f"layer{i}": torch.randn(n, generator=gen) for i in range(8)}


def run_once(size: int, saves: int, wait: bool, work: Path) -> dict:
    """One run (fresh daemons): per save (but the first) the seconds blocked by backpressure and
    the seconds from its ``save`` call to the next one."""
    from trainer_hooks import Checkpointer

    work.mkdir(parents=True)
    (work / "token").write_text(TOKEN)
    os.chmod(work / "token", 0o600)
    os.environ["CKPTD_TOKEN_FILE"] = str(work / "token")
    root = f"file://{work / 'job'}"
    state = _state(size)
    a, b = _daemons(work, root, size, wait)
    blocked, starts = [], []
    try:
        with Checkpointer(root, daemon=a.socket_url, persist_every=10**9, save_timeout=3600) as ck:
            before = a.metric(METRIC, TOKEN)
            for step in range(1, saves + 2):
                state["layer0"][0] = step  # a new state every step
                starts.append(time.perf_counter())
                ck.save(step, state).result()
                now = a.metric(METRIC, TOKEN)
                blocked.append(now - before)
                before = now
            starts.append(time.perf_counter())  # where the next save would start
            held = a.get(f"/v1/tiers?root={root}", TOKEN)[1]["memory_only"]  # type: ignore[index]
            pushes = {k: a.metric(f"ckptd_tier_{k}_total", TOKEN) for k in ("replicas_pushed", "replica_push_failures")}
    finally:
        a.stop()
        b.stop()
    if not any(p["source"] == "self" and p["replicated_to"] for p in held):
        raise RuntimeError(f"no part of daemon a was pushed to b:\n{a.logs()}")
    periods = [t1 - t0 for t0, t1 in zip(starts, starts[1:], strict=False)]
    return {"blocked_s": blocked[1:], "save_to_save_s": periods[1:], "pushes": pushes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backpressure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="state bytes of the rank (e.g. 256MiB, 1.5GiB)")
    parser.add_argument("--saves", type=int, default=8, help="saves measured per run (after a first one)")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="backpressure-"))
    try:
        runs = {
            name: run_once(size, args.saves, wait, work / name) for name, wait in (("with", True), ("without", False))
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def stat(xs: list[float]) -> str:
        return f"{statistics.median(xs):7.3f} / {max(xs):7.3f} s"

    print(f"memory-only saves of {fmt_bytes(size)} per rank, 1 rank, 2 daemons on loopback (1 replica), ", end="")
    print(f"{args.saves} saves back to back; median / max")
    print(f"{'':34}{'with backpressure':>22}{'without':>22}")
    for key, label in (("blocked_s", "blocked by backpressure per save"), ("save_to_save_s", "save-to-save time")):
        print(f"{label:34}{stat(runs['with'][key]):>22}{stat(runs['without'][key]):>22}")
    for name, run in runs.items():
        p = run["pushes"]
        sealed, failed = p["replicas_pushed"], p["replica_push_failures"]
        print(f"{name}: when the last save returned, {sealed:.0f} of a's pushes were sealed, {failed:.0f} had failed")
    print(json.dumps({"size": size, "saves": args.saves, **runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
