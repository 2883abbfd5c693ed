"""``ckptd unquarantine URI --step N [--id ID]``: put a quarantined checkpoint back as committed.

The newest quarantined copy of the step unless ``--id`` (``ckptd quarantine --list``); what refuses
it, and what ``--force`` overrides: ``ckptd.quarantine.unquarantine``. The copy's ``ckptd verify``
record comes back with it, and is printed: a copy recorded bad shows bad in ``ls``."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import quarantine as _q
from ckptd import verify as _verify
from ckptd.cli.common import add_json, add_uri, job_root, print_json, printable, step_arg

__all__ = ["HELP", "add_arguments", "run"]

HELP = "put a quarantined checkpoint back (committed again)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--step", type=step_arg, required=True, help="the step to put back")
    p.add_argument("--id", default=None, help="which quarantined copy (default: the newest of that step)")
    p.add_argument(
        "--force", action="store_true", help="put it back even if later steps were committed after the quarantine"
    )
    add_json(p)


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store:
        rec = _q.unquarantine(store, args.step, args.id, force=args.force)
        where = catalog.where(store, args.step)
        verdict = _verify.status(store, args.step)
    if args.json:
        print_json(rec | {"verified": verdict})
    else:
        print(f"restored {where} from {_q.FOLDER}/{printable(rec['id'])}/ (committed again; verified: {verdict})")
    return 0
