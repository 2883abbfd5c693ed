"""The long fault campaign (issue 14): ``python -m benchmarks.faults [flags]``.

The same events and invariants as the CI campaign (``tests/faults/test_campaign.py``, engine in
``tests.faults.campaign``), in the hundreds: trainers, ``ckptd gc`` and ``ckptd serve`` killed
with SIGKILL at random points; saves through a fault proxy failing 10% and 50% of S3 requests
(500, 503 SlowDown, resets, responses cut or lost after the request took effect, delays,
stalls); a tmpfs filled up at random points of a save; slow writers SIGSTOPped mid-save whose
step another job (or the same job id, restarted) takes over after their lease, then resumed;
S3 writers partitioned but for their data PUTs, held by a proxy of their own until another job
committed their step. After every event every committed step
is verified and the newest restored bitwise; an invariant that fails is counted and quoted, the
campaign goes on. ``--minutes`` bounds the wall time: phases run in turn, each its share.

Writes the table of counts between the markers of ``docs/reliability.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

MARK_BEGIN = "<!-- campaign:begin -->"
MARK_END = "<!-- campaign:end -->"


def _phase(camp, name: str, deadline: float, n: int, event, violations: list[str]) -> int:
    from tests.faults.campaign import InvariantError

    done = 0
    t0 = time.monotonic()
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        try:
            event()
        except InvariantError as e:
            camp.counts["invariant violations"] += 1
            violations.append(f"{name}: {' '.join(str(e).split())[:300]}")
        except AssertionError as e:  # the harness itself (a daemon that did not start in time)
            camp.counts["harness errors (not counted as violations)"] += 1
            print(f"{name}: harness error: {' '.join(str(e).split())[:300]}", flush=True)
        done += 1
    camp.counts[f"seconds: {name}"] += round(time.monotonic() - t0)
    print(f"{name}: {done} events, {time.monotonic() - t0:.0f} s", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--minutes", type=float, default=15.0, help="wall-time bound of the whole campaign")
    ap.add_argument("--local-kills", type=int, default=200, help="trainer kills on a local root")
    ap.add_argument("--gc-kills", type=int, default=30, help="ckptd gc processes killed")
    ap.add_argument("--s3-kills", type=int, default=40, help="trainer kills on S3 with 10%% faulty requests")
    ap.add_argument("--s3-saves", type=int, default=20, help="saves run to completion at each fault rate")
    ap.add_argument("--rates", default="0.1,0.5", help="S3 request fault rates")
    ap.add_argument("--daemon-kills", type=int, default=10)
    ap.add_argument(
        "--slow-writers", type=int, default=10, help="writers SIGSTOPped mid-save, taken over, resumed (half same id)"
    )
    ap.add_argument("--partitions", type=int, default=6, help="S3 writers cut off but for their held data PUTs")
    ap.add_argument("--disk-full", type=int, default=20, help="saves into a nearly full tmpfs")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp folder, removed)")
    ap.add_argument("--out", default="docs/reliability.md", help="markdown file whose table is replaced")
    args = ap.parse_args(argv)

    import boto3

    from benchmarks.s3 import moto_env
    from tests.doubles.faults import KINDS, FaultPlan, FaultProxy, tmpfs_mount
    from tests.faults.campaign import Campaign, Root
    from tests.s3server import CREDENTIALS

    work = Path(args.work or f"/tmp/ckptd-faults-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True, exist_ok=True)
    camp = Campaign(work / "camp", seed=args.seed)
    violations: list[str] = []
    start = time.monotonic()
    end = start + args.minutes * 60
    weights = {"local": 4, "slow": 1, "s3": 4, "partition": 1, "daemon": 1.5, "disk": 1}
    proxy_counts: Counter[str] = Counter()

    def budget(name: str) -> float:
        # each phase gets its share of what is left, so an early phase that ends sooner leaves more
        left = end - time.monotonic()
        rest = sum(w for k, w in weights.items() if k not in done_phases)
        done_phases.add(name)
        return time.monotonic() + left * weights[name] / rest

    done_phases: set[str] = set()
    try:
        # 1. local root: trainer kills, with gc kills among them
        root = Root(str(work / "local"), {})
        deadline = budget("local")
        gc_every = max(1, args.local_kills // max(1, args.gc_kills))
        i = 0

        def local_event():
            nonlocal i
            i += 1
            camp.trainer_kill(root, keep_last=2, window=(0.05, 1.5))
            if i % gc_every == 0:
                camp.gc_kill(root, {})

        _phase(camp, "local trainer and gc kills", deadline, args.local_kills, local_event, violations)
        with contextlib.suppress(Exception):
            camp.run_trainer(root, 2)
            camp.check(root)

        # 1b. slow writers: SIGSTOPped mid-save, their step taken over, resumed (issue 26)
        sroot = Root(str(work / "slow"), {})
        k = 0

        def slow_event():
            nonlocal k
            k += 1
            camp.slow_writer(sroot, same_id=k % 2 == 0)

        with contextlib.suppress(Exception):
            camp.run_trainer(sroot, 1)
        _phase(camp, "slow writers and same-id restarts", budget("slow"), args.slow_writers, slow_event, violations)

        # 2. S3 through the fault proxy
        with moto_env() as url:
            bucket = f"ckptd-faults-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
            with FaultProxy(url) as proxy:
                env = {
                    **CREDENTIALS,
                    "AWS_EC2_METADATA_DISABLED": "true",
                    "AWS_ENDPOINT_URL": proxy.url,
                    "CAMPAIGN_DIRECT_ENDPOINT": url,
                    "CKPTD_S3_PART_SIZE": "5M",
                    "CKPTD_S3_MULTIPART_THRESHOLD": "5M",
                }
                s3 = Root(f"s3://{bucket}/job", env, big=True)
                deadline = budget("s3")
                kinds = (*KINDS, "stall")
                rates = [float(r) for r in args.rates.split(",") if r]
                proxy.set_plan(FaultPlan(rate=rates[0], kinds=kinds, seed=args.seed, delay_s=0.1, stall_s=1.0))
                s3_kill_deadline = time.monotonic() + (deadline - time.monotonic()) * 0.6
                _phase(
                    camp,
                    f"S3 trainer kills at {rates[0]:.0%} faults",
                    s3_kill_deadline,
                    args.s3_kills,
                    lambda: camp.trainer_kill(s3, keep_last=2, window=(0.3, 3.0)),
                    violations,
                )
                for k, rate in enumerate(rates):
                    proxy.set_plan(FaultPlan(rate=rate, kinds=kinds, seed=args.seed + k, delay_s=0.1, stall_s=1.0))
                    before = Counter(camp.counts)

                    def saves(rate=rate):
                        camp.run_trainer(s3, 1, keep_last=2)
                        camp.check(s3, gc=False)

                    rate_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(rates) - k)
                    _phase(camp, f"S3 saves at {rate:.0%} faults", rate_deadline, args.s3_saves, saves, violations)
                    for key in ("saves committed", "saves failed (one clear error)"):
                        camp.counts[f"{key} at {rate:.0%} S3 faults"] += camp.counts[key] - before[key]
                with contextlib.suppress(Exception):
                    camp.check(s3)
                # 2b. partitioned writers (their own proxy holds their data PUTs): no random faults
                proxy.set_plan(FaultPlan())
                _phase(
                    camp,
                    "partitioned writers",
                    budget("partition"),
                    args.partitions,
                    lambda: camp.partition(s3),
                    violations,
                )
                proxy_counts = Counter(proxy.counters)

        # 3. the daemon
        if Path("/dev/shm").is_dir():
            staging = Path("/dev/shm") / f"ckptd-campaign-{uuid.uuid4().hex[:8]}"
            droot = Root(str(work / "daemon"), {})
            try:
                _phase(
                    camp,
                    "daemon kills",
                    budget("daemon"),
                    args.daemon_kills,
                    lambda: camp.daemon_kill(droot, staging, work / "daemon.log"),
                    violations,
                )
            finally:
                shutil.rmtree(staging, ignore_errors=True)

        # 4. disk full
        mnt = work / "small"
        try:
            with tmpfs_mount(str(mnt), "1m"):
                droot = Root(str(mnt / "job"), {})
                camp.run_trainer(droot, 1, keep_last=1)

                def disk_event():
                    free = shutil.disk_usage(mnt).free
                    with open(mnt / "ballast", "wb") as f:
                        f.write(b"\0" * max(0, free - camp.rng.randrange(0, 48 << 10)))
                    lines = camp.run_trainer(droot, 1, keep_last=1)
                    camp.counts["disk-full events"] += 1
                    camp.counts["saves failed with ENOSPC"] += sum(
                        x.startswith("fail") and "No space left" in x for x in lines
                    )
                    camp.check(droot)
                    (mnt / "ballast").unlink()
                    after = camp.run_trainer(droot, 1, keep_last=1)
                    camp.counts["saves after space returned: committed"] += sum(x.startswith("ok") for x in after)
                    camp.counts["saves after space returned: failed"] += sum(x.startswith("fail") for x in after)
                    camp.check(droot)

                _phase(camp, "disk full", budget("disk"), args.disk_full, disk_event, violations)
        except OSError as e:
            print(f"disk-full phase skipped: {e}")
    finally:
        elapsed = time.monotonic() - start
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    _write(Path(args.out), camp.counts, proxy_counts, violations, elapsed, args)
    print(
        f"wrote {args.out}; {sum(v for k, v in camp.counts.items() if k.startswith('kills: ') and ',' not in k)} kills"
    )
    return 1 if violations else 0


def _write(path: Path, counts: Counter, proxy: Counter, violations: list[str], elapsed: float, args) -> None:
    commit = head_commit()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    kills = sum(v for k, v in counts.items() if k.startswith("kills: ") and "," not in k)
    lines = [
        MARK_BEGIN,
        f"Run of {when} on {commit} (seed {args.seed}, {elapsed / 60:.1f} min wall, 2 shared cores): "
        f"{kills} SIGKILLs, {sum(v for k, v in proxy.items() if k.startswith('fault:') and k.count(':') == 1)} "
        f"injected S3 faults, {len(violations)} invariant violations.",
        "",
        "| event or check | count |",
        "|---|---:|",
    ]
    for k in sorted(counts):
        if not k.startswith("seconds: "):
            lines.append(f"| {k} | {counts[k]} |")
    lines += ["", "| S3 fault injected (proxy) | count |", "|---|---:|"]
    for k in sorted(proxy):
        if k.startswith("fault:") and k.count(":") == 1:
            lines.append(f"| {k[6:]} | {proxy[k]} |")
    lines.append(f"| requests through the proxy | {proxy['requests']} |")
    lines += ["", "| phase | seconds |", "|---|---:|"]
    for k in sorted(counts):
        if k.startswith("seconds: "):
            lines.append(f"| {k[9:]} | {counts[k]} |")
    if violations:
        lines += ["", "Invariant violations (first 20):", ""]
        lines += [f"- {v}" for v in violations[:20]]
    lines.append(MARK_END)
    replace_block(path, "\n".join(lines), MARK_BEGIN, MARK_END)


def replace_block(path: Path, block: str, begin: str, end: str) -> None:
    """``block`` (which starts with ``begin`` and ends with ``end``) in place of the text between
    those markers in ``path``, or appended when they are not there."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text + "\n" + block + "\n"
    path.write_text(text)


def head_commit() -> str:
    """The short hash of the checkout the campaign ran on ("?" without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
