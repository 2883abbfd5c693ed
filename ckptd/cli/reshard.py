"""``ckptd reshard URI --to M [--step N] [--layout L] [--rechunk]``: prepare a restart at M ranks.

Validates that the checkpoint restores at M ranks under the layout the job will use, prints what
each rank will read, where the data position resumes, and records the plan in
``<root>/_plans/`` for ``Checkpointer.restore`` at M ranks. ``--rechunk`` also writes a
re-chunked copy (see :mod:`ckptd.plans`). The checkpoint itself is only read.
"""

from __future__ import annotations

import argparse

from ckptd import catalog, plans
from ckptd import manifest as mf
from ckptd import rechunk as _rechunk
from ckptd import reshard as rs
from ckptd.cli.common import (
    Progress,
    UsageError,
    add_json,
    add_step,
    add_uri,
    human_bytes,
    job_root,
    note,
    positive_int,
    print_json,
    print_table,
)
from ckptd.sampler_math import SamplerResume, remap_data_position

__all__ = ["HELP", "MAX_ROWS", "add_arguments", "run"]

HELP = "prepare a checkpoint for a restart at M ranks: validate, plan each rank's reads, record the plan"

MAX_ROWS = 32  # ranks shown in the table; --json has them all


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    p.add_argument("--to", type=positive_int, required=True, metavar="M", help="world size of the restarted job")
    add_step(p)
    p.add_argument(
        "--layout",
        default="fsdp",
        metavar="L",
        help="how the restarted job shards: fsdp (default), ddp (or replicated), tp=T, tp=T,dp=D",
    )
    p.add_argument(
        "--rechunk",
        action="store_true",
        help="also write a copy whose chunks match the M ranks (a new checkpoint beside this one)",
    )
    add_json(p)


def run(args: argparse.Namespace) -> int:
    try:
        target = rs.parse_layout(args.layout, args.to)
    except rs.LayoutSyntaxError as e:
        raise UsageError(str(e)) from None
    with job_root(args.uri) as store:
        m = catalog.load_manifest(store, args.step)
        where = catalog.where(store, m.step)
        plan = rs.plan_reads_for(m.tensors, target, where)  # LayoutError: exit 1 with the reason
        resumes = remap_data_position(m.state, target.world_size)
        if args.rechunk:
            with Progress("rechunking") as progress:
                copy = _rechunk.rechunk(store, m, target, progress=progress)
        else:
            copy = _rechunk.find(store, m, target)
        rechunked = after = None
        if copy is not None:
            after = rs.plan_reads_for(copy.manifest.tensors, target, copy.where)
            rechunked = {
                "root": copy.root,
                "uri": copy.uri,
                "step": copy.step,
                "checkpoint_path": mf.step_dir(copy.step),
                "written_now": not copy.reused,
                "reads": after.to_json(),
            }
        record = plans.make_record(m, target, plan, resumes, rechunked)
        key = plans.write_plan(store, record)
        record["plan_path"] = key
        plan_uri = f"{store.uri.rstrip('/')}/{key}"
    if args.json:
        print_json(record)
        return 0
    _print_text(where, m, target, plan, resumes, copy, after, plan_uri)
    return 0


def _amp(x: float) -> str:
    return f"{x:.2f}x"


def _print_text(where, m, target, plan, resumes, copy, after, plan_uri) -> None:
    print(
        f"{where}: step {m.step}, saved at world size {m.world_size}, {len(m.tensors)} tensors, {human_bytes(m.nbytes)}"
    )
    print(f"target: {target.describe()}: OK")
    print()
    _print_reads(plan)
    print()
    _print_positions(resumes, target.world_size)
    if copy is not None:
        print()
        if copy.reused:
            print(f"rechunked copy (already written, verified then): {copy.where}")
        else:
            print(f"wrote a new committed checkpoint (rechunked, verified): {copy.where}")
            print(f"the checkpoint it was read from is unchanged: {where}")
        big = after.largest
        print(
            f"with the copy: largest rank {big.rank} reads {human_bytes(big.bytes)} in {big.objects} objects "
            f"({_amp(big.amplification)}); all ranks {_amp(after.amplification)}"
        )
    print()
    print(f"plan recorded: {plan_uri}")
    what = "the checkpoint itself" if copy is None else "the rechunked copy through it"
    print(f"Checkpointer.restore at world size {target.world_size} reads {what}")


def _print_reads(plan: rs.ReadPlan) -> None:
    ranks = list(plan.ranks)
    if len(ranks) > MAX_ROWS:
        ranks = sorted(ranks, key=lambda c: (-c.bytes, c.rank))[:MAX_ROWS]
        note(f"showing the {MAX_ROWS} ranks that read most of {len(plan.ranks)}; --json lists them all")
        ranks.sort(key=lambda c: c.rank)
    rows = [(c.rank, human_bytes(c.bytes), c.objects, human_bytes(c.needed), _amp(c.amplification)) for c in ranks]
    print_table(["RANK", "READS", "OBJECTS", "NEEDS", "AMPLIFICATION"], rows)
    big = plan.largest
    print(
        f"largest: rank {big.rank} reads {human_bytes(big.bytes)} ({big.bytes} bytes) in {big.objects} objects; "
        f"all ranks read {human_bytes(plan.bytes)} for {human_bytes(plan.needed)} needed ({_amp(plan.amplification)})"
    )


def _print_positions(resumes: list[SamplerResume], world_size: int) -> None:
    if not resumes:
        print("data position: no ElasticSampler state in the checkpoint; nothing to remap")
        return
    for r in resumes:
        head = f"data position: {r.key!r} (ElasticSampler), epoch {r.epoch}, position {r.position} of {r.dataset_len}"
        print(f"{head}; its state is world-size independent, nothing to rewrite")
        if r.finished:
            print(f"  epoch {r.epoch} is finished: the job moves on with set_epoch({r.epoch + 1})")
            continue
        shown = r.ranks[:MAX_ROWS]
        rows = [(i, p, n) for i, (p, n) in enumerate(shown)]
        print_table(["  RANK", "RESUMES AT", "SAMPLES LEFT"], rows)
        if len(r.ranks) > len(shown):
            print(f"  ... {len(r.ranks) - len(shown)} more ranks (--json lists them all)")
        print(
            f"  {r.dataset_len - r.position} samples left in the epoch; rank r continues at position "
            f"{r.position} + r of the epoch's order, then every {world_size} positions (round-robin)"
        )
