"""``ckptd ls URI``: one row per checkpoint of a job root, committed or partial.

The VERIFIED column (``verified`` in ``--json``) is the verdict ``ckptd verify`` recorded for the
step's current commit: ``ok``, ``bad`` or ``unverified`` (never checked, or checked before it
was saved again); ``-`` for partial steps. A partial step's BYTES reads "written of expected"
(``expected_bytes`` in ``--json``, from its manifest; ``?`` before the manifest is written). A
step folder holding no object at all (a writer killed before its first write landed) is no
checkpoint and is not listed; ``gc`` removes it.

``--daemon URL``: a TIERS column (``tiers`` in ``--json``) names the daemons whose memory holds a
complete copy of each step (``hot@URL``, ``replica@URL``; ``ckptd.cli.tiers_view``), asking that
daemon and the peers it names; a step that only the tiers hold is listed as ``memory-only``
(never as committed: the job root has no commit record of it)."""

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
    """A committed step's size; a partial one's as written of expected, so that a step that
    stopped halfway does not look complete (``?``: its manifest is not there yet)."""
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
    if copies is not None:
        return _with_tiers(args, infos, verified, copies, uri)
    if args.json:
        print_json([i.to_json() | {"verified": verified[i.step]} for i in infos])
        return 0
    if not infos:
        note(f"no checkpoints in {uri}")
        return 0
    rows = [
        (
            i.step,
            "committed" if i.committed else "partial",
            "-" if i.world_size is None else i.world_size,
            _size(i),
            iso_time(i.time),
            verified[i.step] or "-",
            i.path,
        )
        for i in infos
    ]
    print_table(["STEP", "STATUS", "WORLD", "BYTES", "TIME (UTC)", "VERIFIED", "PATH"], rows)
    return 0


def _with_tiers(args, infos, verified, copies: dict[int, list[dict]], uri: str) -> int:
    """The listing with the TIERS column, and a ``memory-only`` row per step only tiers hold."""
    by_step = {i.step: i for i in infos}
    steps = sorted(set(by_step) | set(copies))
    if args.json:
        docs = []
        for s in steps:
            i = by_step.get(s)
            if i is None:
                doc = {"step": s, "committed": False, "memory_only": True}
            else:
                doc = i.to_json() | {"verified": verified[s], "memory_only": False}
            docs.append(doc | {"tiers": copies.get(s, [])})
        print_json(docs)
        return 0
    if not steps:
        note(f"no checkpoints in {uri} or its daemons' memory")
        return 0
    rows = []
    for s in steps:
        i = by_step.get(s)
        where = ", ".join(c["where"] for c in copies.get(s, [])) or "-"
        if i is None:
            rows.append((s, "memory-only", "-", "-", "-", "-", where, "-"))
            continue
        status = "committed" if i.committed else "partial"
        world = "-" if i.world_size is None else i.world_size
        rows.append((s, status, world, _size(i), iso_time(i.time), verified[s] or "-", where, i.path))
    print_table(["STEP", "STATUS", "WORLD", "BYTES", "TIME (UTC)", "VERIFIED", "TIERS", "PATH"], rows)
    return 0
