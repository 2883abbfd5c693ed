"""Micro-benchmark of the pure planning code (``ckptd.layout``) at the scale of a big job.

Simulated job: ``ranks`` FSDP ranks (dim-0 ``torch.chunk`` split, so late ranks of small tensors
hold empty blocks) and ``tensors`` GPT-like tensors (dim 4096: qkv, proj, fc1, fc2 weights and
biases, norms) cycling through a handful of shapes. Nothing touches torch or storage.

* ``plan_reads``: one restoring rank's reads of every tensor, restoring at a *different* world
  size (``ranks - ranks // 4``) what ``ranks`` saved: must take < 1 s, and must not grow with
  the number of ranks (O(chunks touched)).
* save planning as ``trainer_hooks.snapshot.take`` does it for one rank: ``plan_grid`` once per
  distinct signature (shape + sharding + dtype) -- O(ranks) each -- then, per key,
  ``Grid.shards_of`` / ``meta_writer`` (O(1)). With an older ``ckptd.layout`` that has no
  ``plan_grid``, ``plan_writes`` per key (what the save path did then), from a sample of keys.
* scaling: plan_reads time over ranks x tensors grids, to show where the cost grows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from benchmarks.results import Results
from ckptd import layout as _layout
from ckptd.layout import Box, plan_reads, plan_writes, read_cost

SECTION = "planning"
DIM = 4096


def shapes(n: int, dim: int = DIM) -> list[tuple[int, ...]]:
    cycle = [
        (3 * dim, dim),
        (3 * dim,),
        (dim, dim),
        (dim,),
        (4 * dim, dim),
        (4 * dim,),
        (dim, 4 * dim),
        (dim,),
        (dim,),
        (dim,),
    ]
    out = [(16 * dim, dim)]  # embedding
    while len(out) < n:
        out.append(cycle[(len(out) - 1) % len(cycle)])
    return out[:n]


def fsdp_box(shape: Sequence[int], rank: int, world: int) -> Box:
    n = shape[0]
    c = -(-n // world)
    a, b = min(rank * c, n), min((rank + 1) * c, n)
    return Box((a, *[0] * (len(shape) - 1)), (b, *shape[1:]))


def fsdp_blocks(shape: Sequence[int], world: int) -> list[Box]:
    return [fsdp_box(shape, r, world) for r in range(world)]


def _plan_all(sh: list[tuple[int, ...]], ranks: int) -> tuple[dict, float]:
    """One plan per distinct signature (``plan_grid`` when ckptd has it, else ``plan_writes``)."""
    plan = getattr(_layout, "plan_grid", None)
    t0 = time.perf_counter()
    if plan is not None:
        plans = {s: plan(s, 4, "float32", fsdp_blocks(s, ranks)) for s in set(sh)}
    else:
        plans = {s: plan_writes("model/w", s, 4, "float32", fsdp_blocks(s, ranks)) for s in set(sh)}
    return plans, time.perf_counter() - t0


def _save_path(sh: list[tuple[int, ...]], ranks: int, rank: int, sample: int) -> tuple[float, str]:
    """Seconds one rank spends planning the writes of all ``sh`` on its first save."""
    if hasattr(_layout, "plan_grid"):
        t0 = time.perf_counter()
        grids: dict = {}
        n = 0
        for i, s in enumerate(sh):
            g = grids.get(s)
            if g is None:
                g = grids[s] = _layout.plan_grid(s, 4, "float32", fsdp_blocks(s, ranks))
            key = f"model/layers.{i}.w"
            n += len(g.shards_of(key, rank)) + (g.meta_writer(key) == rank)
            if not g.regular:  # what take() asks: this rank's transfers only (older layouts: all)
                g.transfers_of(key, rank) if hasattr(g, "transfers_of") else g.transfers(key)
        return time.perf_counter() - t0, "plan_grid per signature + Grid.shards_of per key"
    part = sh[:sample]
    t0 = time.perf_counter()
    for i, s in enumerate(part):
        plan_writes(f"model/layers.{i}.w", s, 4, "float32", fsdp_blocks(s, ranks))
    per_key = (time.perf_counter() - t0) / max(len(part), 1)
    return per_key * len(sh), f"plan_writes per key (from a sample of {len(part)} keys)"


def _reads(sh, plans, reader: int, world: int) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    shards = chunks = 0
    for s in sh:
        for sr in plan_reads(plans[s].layout, fsdp_box(s, reader, world)):
            shards += 1
            chunks += len(sr.chunks)
    return time.perf_counter() - t0, shards, chunks


def run(
    res: Results,
    ranks: int = 4096,
    tensors: int = 1000,
    per_key_sample: int = 50,
    grid_ranks: Sequence[int] = (512, 1024, 2048, 4096),
    grid_tensors: Sequence[int] = (250, 500, 1000),
    profile_prefix: str | None = None,
) -> dict:
    sec = res.sections.setdefault(SECTION, {})
    sh = shapes(tensors)
    plans, t_sig = _plan_all(sh, ranks)
    target_world = ranks - ranks // 4
    reader = target_world // 2 + 1
    t_reads, n_shards, n_chunks = _reads(sh, plans, reader, target_world)
    t0 = time.perf_counter()
    cost = sum(read_cost(plans[s].layout, fsdp_box(s, reader, target_world))[0] for s in sh)
    t_cost = time.perf_counter() - t0

    t_save, how = _save_path(sh, ranks, reader, per_key_sample)

    if profile_prefix and t_save >= 1.0:
        _profile_plan_writes(profile_prefix, sh[4], ranks, sec)
    grid = []
    for r in grid_ranks:
        for n in grid_tensors:
            s2 = shapes(n)
            p2, tw = _plan_all(s2, r)
            tr, _, ch = _reads(s2, p2, (r - r // 4) // 2 + 1, r - r // 4)
            grid.append({"ranks": r, "tensors": n, "plan_reads_s": tr, "chunks": ch, "plan_writes_per_sig_s": tw})

    def R(id, label, v, unit="s", **extra):  # noqa: N802
        row = res.row(id, SECTION, label, unit=unit)
        res.add(id, 0, v)
        row.extra.update(extra)

    R("planning.reads", f"plan_reads, one rank restoring {tensors} tensors at {target_world} of {ranks} ranks",
      t_reads, shards=n_shards, chunks=n_chunks)  # fmt: skip
    R("planning.read_cost", f"read_cost (what `ckptd reshard` reports), same rank, {tensors} tensors", t_cost,
      bytes=cost)  # fmt: skip
    R("planning.writes_per_signature", f"write plan once per distinct signature ({len(plans)}) at {ranks} ranks",
      t_sig, signatures=len(plans), per_signature_s=t_sig / max(len(plans), 1))  # fmt: skip
    R("planning.save_path", f"one rank's write planning on its first save, {tensors} tensors at {ranks} ranks: {how}",
      t_save)  # fmt: skip

    # Growth with ranks at the largest tensor count: ~1 for O(tensors x chunks), ~ranks ratio for O(ranks).
    big = [g for g in grid if g["tensors"] == max(grid_tensors)]
    lo, hi = big[0], big[-1]
    sec.update(
        {
            "ranks": ranks,
            "tensors": tensors,
            "target_world": target_world,
            "grid": grid,
            "reads_growth_over_ranks": hi["plan_reads_s"] / lo["plan_reads_s"] if lo["plan_reads_s"] else None,
            "writes_growth_over_ranks": (
                hi["plan_writes_per_sig_s"] / lo["plan_writes_per_sig_s"] if lo["plan_writes_per_sig_s"] else None
            ),
            "ranks_growth": hi["ranks"] / lo["ranks"],
        }
    )
    return sec


def _profile_plan_writes(prefix: str, shape: tuple[int, ...], ranks: int, sec: dict) -> None:
    """pyinstrument over plan_writes of one tensor at ``ranks`` ranks (single-threaded code)."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return
    import os

    blocks = fsdp_blocks(shape, ranks)
    p = Profiler(interval=0.0005)
    p.start()
    for i in range(5):
        plan_writes(f"model/layers.{i}.w", shape, 4, "float32", blocks)
    p.stop()
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    path = prefix + "_plan_writes.txt"
    with open(path, "w") as f:
        f.write(f"# pyinstrument: 5 x plan_writes of a {shape} fp32 tensor, FSDP over {ranks} ranks\n\n")
        f.write(p.output_text(unicode=False, color=False))
    sec["profile"] = {"tool": "pyinstrument", "summary": path}
