"""The memory-only step campaign (issue 37 item 6): ``python -m benchmarks.tier_campaign
--kills N --modes node,all,restart,restart-spill --seed S --out docs/reliability.md``.

``N`` kills per mode (engine and modes in ``tests.faults.tier_campaign``), each at a time drawn
uniformly (seeded) over the span the job takes, undisturbed, from step 1's start to the
acknowledgement of step 2K+1 (measured first, or ``--window``): kill points fall in hand-offs,
pushes (half the events hold one step's pushes in flight longer, through the test double) and
between saves alike. Writes the table between the markers of ``docs/reliability.md``; exits 1
when a row misses its goal.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path

from benchmarks.faults import head_commit, replace_block

MARK_BEGIN = "<!-- tier-campaign:begin -->"
MARK_END = "<!-- tier-campaign:end -->"

GOAL_TEXT = {
    "node": "<= 1 after the first K steps",
    "all": "<= acked mod K (the newest persisted step)",
    "restart": "<= acked mod K (the newest persisted step)",
    "restart-spill": "<= 1 after the first K steps",
}


def main(argv: list[str] | None = None) -> int:
    from tests.faults.tier_campaign import EVERY, MODES, RANKS, TierCampaign

    ap = argparse.ArgumentParser(prog="python -m benchmarks.tier_campaign", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=50, help="kills per mode")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument(
        "--window", type=float, default=None, help="seconds the kill times are drawn over (default: measured)"
    )
    ap.add_argument("--minutes", type=float, default=None, help="stop drawing kills after this wall time")
    ap.add_argument(
        "--work", default=None, help="scratch folder (default: a temp folder; events that miss a goal are kept)"
    )
    ap.add_argument("--out", default="docs/reliability.md", help="markdown file whose table is replaced")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {', '.join(MODES)}")

    work = Path(args.work or f"/tmp/ckptd-tier-campaign-{uuid.uuid4().hex[:8]}")
    camp = TierCampaign(work, seed=args.seed)
    start = time.monotonic()
    window = args.window or camp.window()
    print(f"kill times drawn over {window:.1f} s", flush=True)
    end = start + args.minutes * 60 if args.minutes else None
    results = {m: [] for m in modes}
    for i in range(args.kills):  # modes interleaved: a shorter run still covers each
        for m in modes:
            if end is not None and time.monotonic() > end:
                break
            r = camp.random_event(m, window)
            results[m].append(r)
            print(f"[{i + 1}/{args.kills}] {r.line()} -> goal met: {r.met}", flush=True)
    elapsed = time.monotonic() - start
    if args.work is None and not any(r.met is False for rs in results.values() for r in rs):
        shutil.rmtree(work, ignore_errors=True)
    _write(Path(args.out), results, window, elapsed, args, EVERY, RANKS, work)
    return 1 if any(r.met is False for rs in results.values() for r in rs) else 0


def _dist(values) -> str:
    c = Counter(values)
    return ", ".join(f"{k}: {c[k]}" for k in sorted(c)) or "-"


def _med_max(values, fmt: str) -> str:
    return f"{statistics.median_low(values):{fmt}} / {max(values):{fmt}}" if values else "-"


def _write(path: Path, results: dict, window: float, elapsed: float, args, every: int, ranks: int, work: Path) -> None:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        MARK_BEGIN,
        f"Run of {when} on {head_commit()} (seed {args.seed}, {elapsed / 60:.1f} min wall, 2 cores shared with other "
        f"jobs): {ranks} ranks on 2 nodes, persist_every {every}, kill times uniform over {window:.1f} s "
        f"(step 1 to step {2 * every + 1}); each kill restored at {ranks} and {max(1, ranks // 2)} ranks.",
        "",
        "| fault | kills | steps lost (count) | lost, max after first K | goal | wrong restores | hangs "
        "| restore s (median / max) | bytes from root (median / max) | harness errors | goal met |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    violations = []
    for mode, rs in results.items():
        ok = [r for r in rs if not r.error]
        after_k = [r.lost for r in ok if r.acked >= every]
        met = all(r.met is not False for r in ok)
        verdict = "yes" if met and ok else "NO"
        lines.append(
            f"| {mode} | {len(ok)} | {_dist(r.lost for r in ok)} | {max(after_k, default='-')} | {GOAL_TEXT[mode]} "
            f"| {sum(bool(r.wrong) and not r.hang for r in ok)} | {sum(r.hang for r in ok)} "
            f"| {_med_max([s for r in ok for s in r.restore_s], '.1f')} "
            f"| {_med_max([b for r in ok for b in r.root_bytes], ',d')} | {len(rs) - len(ok)} | {verdict} |"
        )
        violations += [f"{r.line()} (kept under {work})" for r in ok if r.met is False]
        violations += [f"harness error: {r.line()}" for r in rs if r.error]
    if violations:
        lines += ["", "Goals missed and harness errors:", ""] + [f"- {v}" for v in violations[:30]]
    lines.append(MARK_END)
    replace_block(path, "\n".join(lines), MARK_BEGIN, MARK_END)
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
