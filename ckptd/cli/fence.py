"""``ckptd fence URI --job OLD [--step N] [--force]``: retire a dead job's claims.

A job that died while saving leaves its partial step claimed; a job resubmitted under a new id
is refused that step until the dead job's claim expires (its lease, ``CKPTD_CLAIM_LEASE_S``).
``fence`` declares the old job dead now, on each of its partial steps (or only step N): the next
writer takes them over at once (``ckptd.fencing``). A live claim (fresh heartbeat) needs ``--force``.
"""

from __future__ import annotations

import argparse

from ckptd import fencing
from ckptd.cli.common import add_json, add_uri, job_root, note, print_json, step_arg
from ckptd.errors import CheckpointError

__all__ = ["HELP", "add_arguments", "run"]

HELP = "retire a dead job's claims on its partial steps, so that another job may save them"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--job", required=True, help="the dead job's id (as named by the refused save)")
    p.add_argument("--step", type=step_arg, default=None, help="only this partial step (default: all of them)")
    p.add_argument("--force", action="store_true", help="fence even a job whose heartbeat is fresh")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store:
        if not store.exists_root():
            raise CheckpointError(f"{store.uri}: no such job root")
        done = fencing.fence(store, args.job, args.step, force=args.force)
        uri = store.uri.rstrip("/")
    if args.json:
        print_json([{"step": f.step, "attempt": f.attempt, "idle_s": round(f.idle, 1)} for f in done])
    elif not done:
        note(f"no partial step of job {args.job!r} in {uri}")
    else:
        for f in done:
            print(f"fenced step {f.step} of job {args.job!r} (attempt {f.attempt}, {f.what} {f.idle:.0f} s ago)")
    return 0
