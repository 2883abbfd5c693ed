"""Incremental saves: fine-tuning with ~90% of the state's bytes frozen.

A ``Checkpointer(incremental=True)`` saves after each simulated fine-tuning step in which only
the trainable tensors (the last blocks and the final norm, with their AdamW state: ~10% of the
bytes) change. The figure is the bytes this process wrote to the disk per save
(``/proc/self/io`` ``write_bytes``, every thread included) over the state's bytes; target
<= 0.15. ``SaveResult.bytes_written`` (what ckptd says it wrote) is kept beside it. A plain
``Checkpointer`` saving the same state, interleaved, gives the full-save time for comparison.
"""

from __future__ import annotations

import inspect
import os
import time

import torch

from benchmarks import state as st
from benchmarks.common import collect, proc_io, remove
from benchmarks.results import ERROR, Results

SECTION = "incremental"


def run(res: Results, size: int, saves: int, bench_dir: str) -> None:
    from trainer_hooks import Checkpointer

    r_bytes = res.row("incremental.bytes", SECTION, "incremental save, ~90% of bytes frozen: bytes written / state",
                      unit="x")  # fmt: skip
    r_time = res.row("incremental.commit", SECTION, "incremental save: time until committed", floor="incremental.full")
    res.row("incremental.full", SECTION, "same state, plain (non-incremental) save: time until committed")
    if "incremental" not in inspect.signature(Checkpointer.__init__).parameters:
        for r in (r_bytes, r_time):
            r.status, r.note = ERROR, "Checkpointer has no incremental option"
        return
    model, optim, dims = st.build_local(size, seed=5)
    state = {"model": model, "optim": optim}
    total = st.nbytes(st.all_tensors(model, optim))
    # Trainable: parameters from the top of the model down (head, final norm, last blocks...),
    # skipping any that would take the trainable share (parameter + its AdamW state) past 10%.
    trainable, tb = [], 0
    for p in reversed(list(model.parameters())):
        nb = 3 * p.numel() * p.element_size()
        if tb + nb <= 0.10 * total:
            trainable.append(p)
            tb += nb
    sec = res.sections.setdefault(SECTION, {})
    sec.update({"state_bytes": total, "trainable_bytes": tb, "trainable_fraction": tb / total,
                "model": st.describe(dims)})  # fmt: skip

    def step() -> None:
        with torch.no_grad():
            for p in trainable:
                p.add_(1e-3)
                s = optim.state[p]
                s["exp_avg"].mul_(0.9)
                s["exp_avg_sq"].mul_(0.999)
                s["step"].add_(1)

    inc_root, full_root = os.path.join(bench_dir, "inc_job"), os.path.join(bench_dir, "full_job")
    inc = Checkpointer(inc_root, keep_last=2, incremental=True)
    full = Checkpointer(full_root, keep_last=1)
    reported = []
    try:
        inc.save(1, state).result()  # the first save writes everything
        for i in range(saves):
            step()
            io0 = proc_io()
            t0 = time.perf_counter()
            out = inc.save(i + 2, state).result()
            t = time.perf_counter() - t0
            io1 = proc_io()
            res.add("incremental.bytes", i, (io1.get("write_bytes", 0) - io0.get("write_bytes", 0)) / total)
            res.add("incremental.commit", i, t)
            reported.append(getattr(out, "bytes_written", None))
            collect()
            t0 = time.perf_counter()
            full.save(i + 2, state).result()
            res.add("incremental.full", i, time.perf_counter() - t0)
            collect()
    finally:
        inc.close()
        full.close()
        remove(inc_root)
        remove(full_root)
    r_bytes.extra["reported_bytes_written_over_state"] = [b / total if b is not None else None for b in reported]
