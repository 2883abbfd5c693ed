"""``ckptd ls URI``: one row per checkpoint of a job root, committed or partial.

VERIFIED, ``--daemon``'s TIERS and HELD columns and its ``memory-only`` rows are described in
docs/operations.md (``verified``, ``tiers``, ``whole`` in ``--json``). A partial step's BYTES reads "written of
expected" (``expected_bytes`` in ``--json``, from its manifest; ``?`` before the manifest is
written). A step folder holding no object at all (a writer killed before its first write landed)
is no checkpoint and is not listed; ``gc`` removes it."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import verify as _verify
from ckptd.cli.common import add_json, add_uri, human_bytes, iso_time, job_root, note, print_json, print_table

__all__ = ["HELP", "add_arguments", "run"]

HELP = "list the checkpoints of a job root (step, committed/partial, world size, bytes, time)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    add_json(p)
    p.add_argument(
        "--daemon",
        metavar="ADDRESS",
        help="also show which daemons' memory tiers hold each step (asks this daemon, unix:///path/ckptd.sock "
        "or http://host:port, and its peers)",
    )


def _size(i: catalog.CheckpointInfo) -> str:
    """A partial step's size as written of expected, so that one stopped halfway does not look
    complete (``?``: its manifest is not there yet)."""
    if i.committed:
        return human_bytes(i.bytes)
    expected = "?" if i.expected_bytes is None else human_bytes(i.expected_bytes)
    return f"{human_bytes(i.bytes)} of {expected}"


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store:
        # A root that does not exist yet (no folder, no bucket) holds no checkpoints: not an error.
        infos = catalog.list_checkpoints(store) if store.exists_root() else []
        ignored = catalog.ignored_names(store) if store.exists_root() else []
        verified = {i.step: _verify.status(store, i.step) if i.committed else None for i in infos}
        uri = store.uri
    for name in ignored:  # on stderr, so ``ls --json`` stays one clean document
        note(f"ignored: {name} (not step_ + 10 digits; never listed, restored or deleted)")
    copies: dict[int, list[dict]] | None = None
    if getattr(args, "daemon", None):
        from ckptd.auth import daemon_token
        from ckptd.cli.tiers_view import tier_copies

        copies, failed = tier_copies(uri, args.daemon, daemon_token())
        for why in failed:
            note(f"memory tier not listed: {why}")
    # With tiers: a TIERS column, and a ``memory-only`` row per step only the tiers hold.
    by_step = {i.step: i for i in infos}
    steps = sorted(by_step.keys() | (copies or {}).keys())
    whole = {s: any(c.get("whole") for c in cs) for s, cs in (copies or {}).items() if s not in by_step}  # memory-only
    if args.json:
        docs = []
        for s in steps:
            i = by_step.get(s)
            doc = {"step": s, "committed": False} if i is None else i.to_json() | {"verified": verified[s]}
            if copies is not None:
                doc |= {"memory_only": i is None, "tiers": copies.get(s, []), "whole": whole.get(s)}
            docs.append(doc)
        print_json(docs)
        return 0
    if not steps:
        note(f"no checkpoints in {uri}" + (" or its daemons' memory" if copies is not None else ""))
        return 0
    rows = []
    for s in steps:
        i = by_step.get(s)
        if i is None:
            row = [s, "memory-only", "-", "-", "-", "-"]
        else:
            status = "committed" if i.committed else "partial"
            world = "-" if i.world_size is None else i.world_size
            row = [s, status, world, _size(i), iso_time(i.time), verified[s] or "-"]
        if copies is not None:
            row.append({True: "whole", False: "partial", None: "-"}[whole.get(s)])
            row.append(", ".join(c["where"] for c in copies.get(s, [])) or "-")
        rows.append((*row, "-" if i is None else i.path))
    headers = ["STEP", "STATUS", "WORLD", "BYTES", "TIME (UTC)", "VERIFIED", "HELD", "TIERS", "PATH"]
    print_table([h for h in headers if h not in ("HELD", "TIERS") or copies is not None], rows)
    return 0
