"""Run the benchmark suite: ``python -m benchmarks.run --size 1.5GiB --out results.json``.

Prints a table, writes the JSON, a markdown report (``benchmarks/RESULTS.md`` by default; with
``--quick``, ``RESULTS-quick.md`` beside the JSON so a smoke run never overwrites the committed
report) and a PNG chart beside the report. ``--only`` takes a comma-separated list of sections
(planning, local, incremental, reshard, s3, rgw, memory, gpu, tiers) or local systems (floor, torch, dcp, ckptd,
daemon).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.common import GiB, MiB, drop_cache, fmt_bytes, machine_info, parse_size
from benchmarks.results import ERROR, Results

HERE = Path(__file__).resolve().parent
SECTIONS = ("planning", "local", "incremental", "reshard", "s3", "rgw", "memory", "gpu", "tiers")
LOCAL_SYSTEMS = ("floor", "torch", "dcp", "ckptd", "daemon")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1.5GiB", help="state size: fp32 parameters + AdamW state (default 1.5GiB)")
    p.add_argument("--quick", action="store_true", help="a ~64 MiB smoke run (2 repetitions, no profiles)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per row (default 5; 2 with --quick)")
    p.add_argument("--out", default="results.json", help="JSON output (default results.json)")
    p.add_argument("--report", default=None, help="markdown report (default benchmarks/RESULTS.md)")
    p.add_argument("--only", default=None, help="comma-separated sections or local systems to run")
    p.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp folder)")
    p.add_argument("--s3-size", default=None, help="state size for the S3 rows (default: min(size, 256MiB))")
    p.add_argument("--mem-size", default=None, help="state size for the memory rows (default: min(size, 256MiB))")
    p.add_argument("--mem-saves", type=int, default=50, help="consecutive saves in the memory rows (default 50)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy/pyinstrument profiles")
    p.add_argument("--profile", action="store_true", help="profile even with --quick")
    p.add_argument("--profiles-dir", default=str(HERE / "profiles"), help="where profile texts go")
    p.add_argument("--from-json", default=None, help="measure nothing: rebuild the report from this JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.size = "64MiB" if "--size" not in (argv if argv is not None else sys.argv) else a.size
        a.no_profile = not a.profile
    a.size_bytes = parse_size(a.size)
    a.reps = a.reps or (2 if a.quick else 5)
    a.s3_bytes = parse_size(a.s3_size) if a.s3_size else min(a.size_bytes, 256 * MiB)
    a.mem_bytes = parse_size(a.mem_size) if a.mem_size else min(a.size_bytes, 256 * MiB)
    if a.report is None:
        a.report = str(Path(a.out).with_name("RESULTS-quick.md")) if a.quick else str(HERE / "RESULTS.md")
    a.only_set = {t.strip() for t in a.only.split(",") if t.strip()} if a.only else None
    unknown = (a.only_set or set()) - set(SECTIONS) - set(LOCAL_SYSTEMS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS + LOCAL_SYSTEMS)}")
    return a


def want(a: argparse.Namespace, name: str) -> bool:
    if a.only_set is None:
        return True
    if name == "local":
        return "local" in a.only_set or bool(a.only_set & set(LOCAL_SYSTEMS))
    return name in a.only_set


def local_selected(a: argparse.Namespace):
    def sel(system: str) -> bool:
        if a.only_set is None or "local" in a.only_set:
            return True
        return system == "floor" or system in a.only_set  # floors always: every ratio needs them

    return sel


def run(a: argparse.Namespace) -> Results:
    from benchmarks import gpu, incremental, inproc, memory, planning, reshard, s3, tiers

    res = Results()
    bench_dir = a.dir or tempfile.mkdtemp(prefix="ckptd-bench-")
    os.makedirs(bench_dir, exist_ok=True)
    prof = None if a.no_profile else a.profiles_dir
    if prof:
        os.makedirs(prof, exist_ok=True)
    res.meta = {
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]),
        "size": a.size_bytes,
        "size_text": fmt_bytes(a.size_bytes),
        "reps": a.reps,
        "s3_size": a.s3_bytes,
        "mem_size": a.mem_bytes,
        "mem_saves": a.mem_saves,
        "quick": a.quick,
        "machine": machine_info(bench_dir),
    }
    timings = res.meta["section_seconds"] = {}

    def section(name: str, fn) -> None:
        if not want(a, name):
            return
        print(f"== {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            tb = traceback.format_exc()
            print(tb, file=sys.stderr)
            res.skip(f"{name}.error", name, f"{name}: the section failed", f"{type(e).__name__}: {e}", ERROR)
            res.sections.setdefault(name, {})["traceback"] = tb[-4000:]
        timings[name] = round(time.perf_counter() - t0, 1)
        print(f"   {name} took {timings[name]:.0f} s", flush=True)

    def p(name: str) -> str | None:
        return os.path.join(prof, name) if prof else None

    quick_grid = {"grid_ranks": (512, 4096), "grid_tensors": (250, 1000)} if a.quick else {}
    section("planning", lambda: planning.run(res, profile_prefix=p("planning"), **quick_grid))
    section("local", lambda: inproc.run(res, a.size_bytes, a.reps, bench_dir, local_selected(a), p("local_ckptd")))
    section("incremental", lambda: incremental.run(res, min(a.size_bytes, 512 * MiB), a.reps, bench_dir))
    section("reshard", lambda: reshard.run(res, a.size_bytes, a.reps, bench_dir, p("reshard_ckptd")))
    section("s3", lambda: s3.run(res, a.s3_bytes, a.reps, lambda _: True, p("s3_ckptd")))
    section("rgw", lambda: s3.run(res, a.s3_bytes, a.reps, lambda _: True, p("rgw_ckptd"), section="rgw"))
    section("memory", lambda: memory.run(res, a.mem_bytes, a.mem_saves, bench_dir))
    section("gpu", lambda: gpu.run(res, a.size_bytes, a.reps, bench_dir))
    section("tiers", lambda: tiers.run(res, a.s3_bytes, a.reps, bench_dir))
    if not want(a, "gpu"):
        gpu.mark_skipped(res, "not selected (--only)")
    res.meta["cache_drop"] = drop_cache.method or "none needed"
    res.meta["cache_drop_errors"] = drop_cache.errors[:3]
    if not a.dir:
        import shutil

        shutil.rmtree(bench_dir, ignore_errors=True)
    res.finalize()
    return res


def main(argv: list[str] | None = None) -> int:
    from benchmarks import report, targets

    a = parse_args(argv)
    if a.from_json:
        res = Results.from_json(json.loads(Path(a.from_json).read_text()))
        targets.evaluate(res, a.profiles_dir)
        print(report.table(res))
        chart = report.chart(res, str(Path(a.report).with_suffix(".png")))
        report.write_markdown(res, a.report, chart)
        print(f"\nreport: {a.report}")
        return 0
    if a.size_bytes > 4 * GiB:
        print(f"note: {fmt_bytes(a.size_bytes)} of state is held several times in memory", file=sys.stderr)
    t0 = time.perf_counter()
    res = run(a)
    res.meta["wall_s"] = round(time.perf_counter() - t0, 1)
    targets.evaluate(res, a.profiles_dir if not a.no_profile else None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res.to_json(), indent=1, default=str))
    print(report.table(res))
    chart = report.chart(res, str(Path(a.report).with_suffix(".png")))
    report.write_markdown(res, a.report, chart)
    print(f"\nJSON: {a.out}\nreport: {a.report}" + (f"\nchart: {chart}" if chart else ""))
    print(f"wall time: {res.meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
