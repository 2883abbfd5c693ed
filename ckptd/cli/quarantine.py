"""``ckptd quarantine URI --step N [--reason TEXT]``: retire a bad checkpoint, keeping its bytes
under ``URI/_quarantine/<id>/`` (``ckptd.quarantine``; the runbook is docs/operations.md).
``--list`` shows what is quarantined; ``ckptd unquarantine`` puts a copy back."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import quarantine as _q
from ckptd.cli.common import (
    UsageError,
    add_json,
    add_uri,
    human_bytes,
    iso_time,
    job_root,
    note,
    print_json,
    print_table,
    step_arg,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "retire a bad checkpoint: it is no longer committed, its bytes are kept under _quarantine/"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--step", type=step_arg, default=None, help="the committed step to retire")
    p.add_argument("--reason", default="", help="why (kept in the quarantine record)")
    p.add_argument("--list", action="store_true", help="list quarantined checkpoints instead")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    if args.list == (args.step is not None):
        raise UsageError("give --step N (to quarantine it) or --list")
    with job_root(args.uri) as store:
        if args.list:
            recs = _q.list_quarantined(store) if store.exists_root() else []
            if args.json:
                print_json(recs)
            elif not recs:
                note(f"nothing quarantined in {store.uri}")
            else:
                rows = [
                    (
                        r.get("step", "-"),
                        iso_time(r.get("time")),
                        human_bytes(r.get("bytes")),
                        r["id"],
                        r.get("reason", ""),
                    )
                    for r in recs
                ]
                print_table(["STEP", "QUARANTINED (UTC)", "BYTES", "ID", "REASON"], rows)
            return 0
        rec = _q.quarantine(store, args.step, args.reason)
        where = catalog.where(store, args.step)
        uri = store.uri.rstrip("/")
    if args.json:
        print_json(rec)
    else:
        print(f"quarantined {where}: moved to {uri}/{_q.FOLDER}/{rec['id']}/ ({rec['objects']} objects)")
    return 0
