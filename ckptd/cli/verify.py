"""``ckptd verify URI [--step N | --all]``: re-read every chunk of a checkpoint and check its crc32c.

``--all`` checks every committed step, newest first, goes on past bad ones, and records each
verdict beside its checkpoint (``ckptd.verify``; read by ``ls``, ``gc``, ``restore(fallback=True)``).
One step is only checked, unless ``--record``. A root where the verdict cannot be written
(read-only credentials) is still checked; the command says the verdict was not recorded.
"""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import manifest as mf
from ckptd import verify as _verify
from ckptd.cli.common import (
    EXIT_FAILED,
    Progress,
    UsageError,
    add_json,
    add_step,
    add_uri,
    error,
    human_bytes,
    job_root,
    note,
    print_json,
    printable,
)
from ckptd.errors import CheckpointError

__all__ = ["HELP", "add_arguments", "run"]

HELP = "re-read every chunk of a checkpoint and check it; exit 1 naming the first bad one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    add_step(p)
    p.add_argument(
        "--all", action="store_true", help="verify every committed step (newest first) and record each verdict"
    )
    p.add_argument("--record", action="store_true", help="record the verdict of one step (--all always does)")
    add_json(p)
    p.add_argument("--keep-going", action="store_true", help="check everything and report every bad array")
    p.add_argument("--threads", type=int, default=8, help="parallel reads (default 8)")


def _check(store, step: int, args: argparse.Namespace, progress) -> _verify.VerifyReport:
    """Verify one committed step; a manifest that does not load is a failed verdict too."""
    try:
        return _verify.verify(
            store, step, threads=max(1, args.threads), keep_going=args.keep_going or args.all, progress=progress
        )
    except CheckpointError as e:
        if catalog.read_commit(store, step) is None:
            raise  # not committed (any more): nothing to give a verdict on
        return _verify.VerifyReport(step, errors=[str(e)])


def _record(store, report: _verify.VerifyReport) -> bool:
    try:
        _verify.write_record(store, report)
    except CheckpointError as e:
        note(f"verdict not recorded: {e}")
        return False
    return True


def _as_json(report: _verify.VerifyReport, recorded: bool) -> dict:
    counts = {k: getattr(report, k) for k in ("arrays", "objects", "bytes", "errors", "warnings")}
    return {
        "step": report.step,
        "checkpoint_path": mf.step_dir(report.step),
        "ok": report.ok,
        **counts,
        "recorded": recorded,
    }


def run(args: argparse.Namespace) -> int:
    if args.all and args.step is not None:
        raise UsageError("give --step N or --all, not both")
    results: list[tuple[_verify.VerifyReport, bool]] = []
    with job_root(args.uri) as store, Progress("verifying") as progress:
        if args.all:
            todo = list(reversed(catalog.committed_steps(store))) if store.exists_root() else []
            if not todo:
                raise CheckpointError(f"{store.uri}: no committed checkpoint")
        else:
            todo = [catalog.resolve_step(store, args.step)]
        for step in todo:
            report = _check(store, step, args, progress)
            results.append((report, _record(store, report) if args.all or args.record else False))
    if args.json:
        out = [_as_json(r, rec) for r, rec in results]
        print_json(out if args.all else out[0])
    for report, _ in results:
        for w in report.warnings:
            note(f"warning: {w}")
    bad = [r for r, _ in results if not r.ok]
    if args.json or not args.all:
        for report in bad:
            for e in report.errors:
                error(e)
    if not args.json:
        for report, _ in results:
            where = catalog.where(store, report.step)  # only its URI: the store may be closed
            if report.ok:
                print(
                    f"{where}: OK: {report.arrays} arrays, {report.objects} objects, "
                    f"{human_bytes(report.bytes)} ({report.bytes} bytes) checked"
                )
            elif args.all:
                # once per bad step: its first error here, the others (--keep-going) below it
                print(f"{where}: BAD: {printable(report.errors[0])}")
                for e in report.errors[1:]:
                    print(f"  also: {printable(e)}")
        if args.all and bad:
            error(f"{len(bad)} of {len(results)} steps bad: {', '.join(str(r.step) for r in bad)}")
    return EXIT_FAILED if bad else 0
