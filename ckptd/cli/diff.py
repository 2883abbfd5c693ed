"""``ckptd diff URI_A URI_B [--step-a N] [--step-b M] [--json]``: are two checkpoints the same values?

Exit 0 when every tensor is bitwise equal and the non-tensor state is equal, 1 when anything
differs (or a step is not committed, or a chunk is corrupt), 2 on bad usage. Works across
layouts and reads in bounded memory (``ckptd.diff``); a progress bar on a terminal."""

from __future__ import annotations

import argparse

from ckptd import diff as _diff
from ckptd.cli.common import (
    EXIT_FAILED,
    Progress,
    UsageError,
    add_json,
    human_bytes,
    job_root,
    print_json,
    print_table,
    printable,
    shape_str,
    step_arg,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "compare two checkpoints value by value (any layouts); exit 0 all equal, 1 differ"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri_a", metavar="URI_A", help="job root of the first checkpoint")
    p.add_argument("uri_b", metavar="URI_B", help="job root of the second (may be the same root)")
    p.add_argument("--step-a", type=step_arg, default=None, help="step in URI_A (default: latest committed)")
    p.add_argument("--step-b", type=step_arg, default=None, help="step in URI_B (default: latest committed)")
    p.add_argument(
        "--block-mib", type=int, default=_diff.BLOCK_BYTES >> 20, help="MiB read per side at a time (default 64)"
    )
    p.add_argument("--all", action="store_true", help="list equal tensors too (default: only the others)")
    add_json(p)


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def run(args: argparse.Namespace) -> int:
    if args.block_mib < 1:
        raise UsageError(f"--block-mib must be >= 1, got {args.block_mib}")
    with job_root(args.uri_a) as a, job_root(args.uri_b) as b, Progress("comparing") as progress:
        report = _diff.diff(a, b, args.step_a, args.step_b, block_bytes=args.block_mib << 20, progress=progress)
    if args.json:
        print_json(report.to_json())
        return 0 if report.equal else EXIT_FAILED
    rows = []
    for t in report.tensors:
        if t.status == "equal" and not args.all:
            continue
        shape = shape_str(t.shape_a if t.shape_a is not None else t.shape_b)
        if t.status == "mismatch":
            shape = f"{shape_str(t.shape_a)} vs {shape_str(t.shape_b)}"
        if t.dtype_a is None or t.dtype_b is None or t.dtype_a == t.dtype_b:
            dtype = t.dtype_a or t.dtype_b
        else:
            dtype = f"{t.dtype_a} vs {t.dtype_b}"
        ulps = _num(t.max_ulps)
        if t.cross_zero:  # ulps across zero mean nothing: those pairs are in MAX_REL_DIFF
            ulps = f"{ulps} ({t.cross_zero} across 0)"
        rows.append([t.key, t.status, shape, dtype, t.different, _num(t.max_abs_diff), _num(t.max_rel_diff), ulps])
    if rows:
        print_table(["KEY", "STATUS", "SHAPE", "DTYPE", "DIFFERENT", "MAX_ABS_DIFF", "MAX_REL_DIFF", "MAX_ULPS"], rows)
    for s in report.state:
        print(printable(f"state {s['path']}: {s['a']} != {s['b']}"))
    c = report.counts()
    parts = [f"{c.get(k, 0)} {k.replace('_', ' ')}" for k in ("equal", "different", "mismatch", "only_a", "only_b")]
    state = "equal" if not report.state else f"{len(report.state)} differences"
    verdict = "EQUAL" if report.equal else "DIFFERENT"
    print(
        f"{verdict}: {report.uri_a} step {report.step_a} vs {report.uri_b} step {report.step_b}: "
        f"tensors {', '.join(parts)}; state {state}; {human_bytes(report.bytes_compared)} compared per side"
    )
    return 0 if report.equal else EXIT_FAILED
