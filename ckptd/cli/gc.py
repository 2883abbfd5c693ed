"""``ckptd gc URI --keep-last K``: delete old checkpoints by the same policy the trainer uses."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.cli.common import Progress, add_json, add_uri, job_root, note, positive_int, print_json

__all__ = ["HELP", "add_arguments", "run"]

HELP = "keep the newest K committed checkpoints; delete older ones and stale partial ones"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--keep-last", type=positive_int, required=True, metavar="K", help="committed checkpoints to keep")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store:
        doomed = catalog.select_for_deletion(store, args.keep_last) if store.exists_root() else []
        if not args.dry_run:
            with Progress("deleting") as progress:
                for i, step in enumerate(doomed):
                    catalog.delete_checkpoint(store, step)
                    progress(i + 1, len(doomed))
        kept = [s for s in catalog.steps(store) if s not in doomed] if store.exists_root() else []
        uri = store.uri
    if args.json:
        print_json(
            {
                "dry_run": args.dry_run,
                "keep_last": args.keep_last,
                "deleted": doomed,
                "deleted_paths": [mf.step_dir(s) for s in doomed],
                "kept": kept,
            }
        )
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for step in doomed:
        print(f"{verb} {mf.step_dir(step)}")
    if not doomed:
        note(f"nothing to delete in {uri}")
    return 0
