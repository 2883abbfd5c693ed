"""``ckptd gc URI --keep-last K``: delete old checkpoints by the same policy the trainer uses.

What it deletes (old committed and partial steps, stale incomplete writes) and what it leaves
(a partial step newer than the newest commit: a save in flight) is in docs/operations.md; what it
never deletes is ``ckptd.retention``'s invariant. ``--dry-run`` lists the same steps with the files
and bytes under each (a listing, no reads). What it prints is counted from what was removed, and a
step whose folder is still there afterwards is reported and fails the command.
"""

from __future__ import annotations

import argparse
import re

from ckptd import catalog, retention
from ckptd import manifest as mf
from ckptd.cli.common import (
    EXIT_FAILED,
    Progress,
    add_json,
    add_uri,
    error,
    human_bytes,
    job_root,
    note,
    positive_int,
    print_json,
    printable,
)

__all__ = ["HELP", "add_arguments", "duration", "run"]

HELP = "keep the newest K committed checkpoints; delete older ones, stale partial ones and stale uploads"

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``24h``, ``7d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected e.g. 0, 90s, 15m, 24h, 7d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--keep-last", type=positive_int, required=True, metavar="K", help="committed checkpoints to keep")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.add_argument(
        "--abort-uploads-older-than",
        type=duration,
        default=duration("24h"),
        metavar="AGE",
        help="abort incomplete S3 multipart uploads (remove temp files, on a filesystem) under the root begun "
        "longer ago than this (default 24h; 0: all, only when no save is running)",
    )
    p.add_argument(
        "--max-step-jump",
        type=int,
        default=None,
        metavar="N",
        help="a committed step more than N past the one before it is kept and not counted among the newest K "
        "(default: CKPTD_MAX_STEP_JUMP, else 1000000; 0: no bound)",
    )
    add_json(p)


def run(args: argparse.Namespace) -> int:
    removed: dict[int, tuple[int, int]] = {}
    left: list[str] = []
    aborted: list[str] = []
    max_jump = retention.max_step_jump_default() if args.max_step_jump is None else (args.max_step_jump or None)
    with job_root(args.uri) as store:
        exists = store.exists_root()
        plan = retention.plan(store, args.keep_last, max_step_jump=max_jump) if exists else retention.Plan()
        doomed = plan.doomed
        for step, why in sorted(plan.failed.items(), reverse=True):
            note(f"{mf.step_dir(step)} fails the restorability check ({printable(why)}); not counted as restorable")
        if plan.restorable is not None and plan.failed:
            note(f"keeping {mf.step_dir(plan.restorable)}: the newest step that passes the check")
        if plan.out_of_nowhere:
            steps = ", ".join(str(s) for s in plan.out_of_nowhere)
            note(
                f"steps {steps} jumped more than {max_jump} past the step before them: kept, not counted in --keep-last"
            )
        if args.dry_run:
            for step in doomed:
                objs = list(store.list(f"{mf.step_dir(step)}/"))
                removed[step] = (len(objs), sum(o.size for o in objs))
        if not args.dry_run and exists:
            with Progress("deleting") as progress:
                for i, step in enumerate(doomed):
                    removed[step] = catalog.delete_checkpoint(store, step)
                    progress(i + 1, len(doomed))
            remaining = set(catalog.steps(store))
            left = [mf.step_dir(s) for s in doomed if s in remaining]
            aborted = store.abort_stale_uploads(args.abort_uploads_older_than)
        kept = [s for s in catalog.steps(store) if s not in doomed] if exists else []
        uri = store.uri
    files = sum(n for n, _ in removed.values())
    nbytes = sum(b for _, b in removed.values())
    if args.json:
        print_json(
            {
                "dry_run": args.dry_run,
                "keep_last": args.keep_last,
                "deleted": doomed,
                "deleted_paths": [mf.step_dir(s) for s in doomed],
                "deleted_objects": files,
                "deleted_bytes": nbytes,
                "left_behind": left,
                "aborted_uploads": aborted,
                "kept": kept,
                "restorable": plan.restorable,
                "not_restorable": {str(s): w for s, w in plan.failed.items()},
                "out_of_nowhere": plan.out_of_nowhere,
            }
        )
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for step in doomed:
            if args.dry_run or mf.step_dir(step) not in left:
                n, b = removed[step]
                print(f"{verb} {mf.step_dir(step)} ({n} files, {human_bytes(b)})")
        for key in aborted:
            print(f"aborted incomplete upload {printable(key)}")
        if not doomed and not aborted:
            note(f"nothing to delete in {uri}")
        elif doomed and args.dry_run:
            print(f"would delete {len(doomed)} checkpoints: {files} files, {human_bytes(nbytes)} ({nbytes} bytes)")
    for path in left:
        error(f"{uri.rstrip('/')}/{path}: still there after deleting (something else is in that folder)")
    return EXIT_FAILED if left else 0
