"""``ckptd verify URI [--step N]``: re-read every chunk of a checkpoint and check its crc32c."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import manifest as mf
from ckptd import verify as _verify
from ckptd.cli.common import (
    EXIT_FAILED,
    Progress,
    add_json,
    add_step,
    add_uri,
    error,
    human_bytes,
    job_root,
    print_json,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "re-read every chunk of a checkpoint and check it; exit 1 naming the first bad one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    add_step(p)
    add_json(p)
    p.add_argument("--keep-going", action="store_true", help="check everything and report every bad array")
    p.add_argument("--threads", type=int, default=8, help="parallel reads (default 8)")


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store, Progress("verifying") as progress:
        report = _verify.verify(
            store, args.step, threads=max(1, args.threads), keep_going=args.keep_going, progress=progress
        )
        where = catalog.where(store, report.step)
    if args.json:
        print_json(
            {
                "step": report.step,
                "checkpoint_path": mf.step_dir(report.step),
                "ok": report.ok,
                "arrays": report.arrays,
                "objects": report.objects,
                "bytes": report.bytes,
                "errors": report.errors,
            }
        )
    if not report.ok:
        for e in report.errors:
            error(e)
        return EXIT_FAILED
    if not args.json:
        print(
            f"{where}: OK: {report.arrays} arrays, {report.objects} objects, "
            f"{human_bytes(report.bytes)} ({report.bytes} bytes) checked"
        )
    return 0
