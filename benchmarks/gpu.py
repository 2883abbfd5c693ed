"""GPU rows (issue 5, item 4): how long a save stalls training when the state is on a CUDA device.

ckptd's snapshot copies each shard device-to-host into pinned buffers allocated once, on a side
stream; ``save`` returns once the copies are queued, and the training stream waits for them on
the GPU (an event), so the host never blocks on them and a parameter update cannot start before
its bytes are copied. The rows, each repetition interleaving the systems like the local rows:

* ``gpu.floor.d2h``: ``copy_(non_blocking=True)`` of every device tensor into pinned buffers
  allocated beforehand, on a side stream, until that stream is done: the least a consistent
  snapshot of device memory costs (the copy engine's bandwidth);
* ``gpu.ckptd.block``: ``Checkpointer.save``'s return; ``gpu.ckptd.stall``: its return plus
  ``torch.cuda.synchronize()``, i.e. until the copies have landed, which is what the training
  stream waits for; ``gpu.ckptd.commit``: until committed on the local disk;
* ``gpu.dcp.<variant>.block`` / ``.commit``: ``dcp.async_save`` with its default staging, and with
  a ``DefaultStager`` with pinned, cached buffers and non-blocking copies (its best option for
  GPU state), until the snapshot is safe to mutate / until written.

Without CUDA (this project's CI and dev machines) the rows are marked as skipped, saying why.
``run(..., device="cpu")`` runs the same code on CPU tensors (no pinning, no streams): the smoke
test uses it to keep this file from rotting where no GPU is lent.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch

from benchmarks import state as st
from benchmarks.common import Timer, collect, dcp_staged, fmt_bytes, remove, rotate
from benchmarks.results import SKIPPED, Results

SECTION = "gpu"
ROWS = {
    "gpu.floor.d2h": "D2H copy into preallocated pinned buffers on a side stream (snapshot floor)",
    "gpu.ckptd.block": "ckptd save with the state on the GPU: time save() blocks the host",
    "gpu.ckptd.stall": "ckptd save: until its D2H copies have landed (what the training stream waits for)",
    "gpu.ckptd.commit": "ckptd save: until committed (local disk)",
    "gpu.dcp.default.block": "dcp.async_save default -- until safe to mutate",
    "gpu.dcp.default.commit": "dcp.async_save default -- until written",
    "gpu.dcp.pinned.block": "dcp.async_save + DefaultStager(pinned cached buffers, non-blocking copies) -- until safe",
    "gpu.dcp.pinned.commit": "dcp.async_save + DefaultStager(pinned cached buffers, non-blocking copies) -- written",
}


def mark_skipped(res: Results, why: str) -> None:
    for rid, label in ROWS.items():
        res.skip(rid, SECTION, label, why, SKIPPED)


def _to_device(model: torch.nn.Module, optim: torch.optim.Optimizer, device: str) -> None:
    model.to(device)  # moves each parameter's data in place: the optimizer's keys stay valid
    for s in optim.state.values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # step counts stay CPU scalars
                s[k] = v.to(device)


def run(res: Results, size: int, reps: int, bench_dir: str, device: str | None = None) -> None:
    """The GPU rows on ``device`` (default: ``cuda`` if torch sees one, else the rows are skipped)."""
    if device is None:
        if not torch.cuda.is_available():
            mark_skipped(res, "no CUDA device on this machine (CI and the dev machines have none)")
            return
        device = "cuda"
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from trainer_hooks import Checkpointer

    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model, optim, dims = st.build_local(size, seed=0)
    _to_device(model, optim, device)
    state = {"model": model, "optim": optim}
    tensors = [t for t in st.all_tensors(model, optim) if t.dim() > 0]
    total = st.nbytes(tensors)
    sec = res.sections.setdefault(SECTION, {})
    sec.update(state_bytes=total, state=fmt_bytes(total), model=st.describe(dims), device=device, reps=reps)
    if cuda:
        sec["gpu"] = torch.cuda.get_device_name()
    for rid, label in ROWS.items():
        floor = "gpu.floor.d2h" if rid.endswith((".block", ".stall")) else None
        dcp_ref = "gpu.dcp.default.block" if rid.startswith("gpu.ckptd") and floor else None
        res.row(rid, SECTION, label, floor=floor, dcp=dcp_ref)

    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    for b in bufs:
        b.zero_()  # first touch outside any timing
    side = torch.cuda.Stream() if cuda else None

    def floor(rep: int) -> None:
        sync()
        with Timer() as t:
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                if cuda:
                    side.wait_stream(torch.cuda.current_stream())
                for b, x in zip(bufs, tensors, strict=True):
                    b.copy_(x, non_blocking=cuda)
            if cuda:
                side.synchronize()
        if rep >= 0:
            res.add("gpu.floor.d2h", rep, t.s)

    ck = Checkpointer(os.path.join(bench_dir, "gpu_ckptd"), keep_last=1)
    steps = [0]

    def ckptd(rep: int) -> None:
        sync()
        steps[0] += 1
        t0 = time.perf_counter()
        fut = ck.save(steps[0], state)
        t_block = time.perf_counter() - t0
        sync()
        t_stall = time.perf_counter() - t0
        fut.result()
        t_commit = time.perf_counter() - t0
        ck.wait_idle()  # retention after the commit stays out of the next system's time
        if rep >= 0:
            res.add("gpu.ckptd.block", rep, t_block)
            res.add("gpu.ckptd.stall", rep, t_stall)
            res.add("gpu.ckptd.commit", rep, t_commit)

    stager = None
    if cuda:  # pinning needs CUDA; on CPU torch ignores or refuses it (see inproc)
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=True))  # fmt: skip

    def dcp_async(variant: str):
        def go(rep: int) -> None:
            p = os.path.join(bench_dir, f"gpu_dcp_{variant}")
            remove(p)
            sync()
            t0 = time.perf_counter()
            sd = st.dcp_state(model, optim)
            if variant == "default":
                r = dcp.async_save(sd, checkpoint_id=p)
            else:
                r = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=4), async_stager=stager)
            r = dcp_staged(r)
            sync()
            t_safe = time.perf_counter() - t0
            r.result()
            t_commit = time.perf_counter() - t0
            remove(p)
            if rep >= 0:
                res.add(f"gpu.dcp.{variant}.block", rep, t_safe)
                res.add(f"gpu.dcp.{variant}.commit", rep, t_commit)

        return go

    systems = [floor, ckptd, dcp_async("default")]
    if stager is not None:
        systems.append(dcp_async("pinned"))
    else:
        for k in ("block", "commit"):
            res.rows[f"gpu.dcp.pinned.{k}"].status = SKIPPED
            res.rows[f"gpu.dcp.pinned.{k}"].note = "pinned staging needs CUDA"
    try:
        for s in systems:  # warm-up: buffer allocation and first-call costs stay out of the figures
            s(-1)
        for rep in range(reps):
            for s in rotate(systems, rep):
                s(rep)
                collect()
    finally:
        ck.close()
        if stager is not None:
            stager.close()
        for name in os.listdir(bench_dir):
            if name.startswith("gpu_"):
                remove(os.path.join(bench_dir, name))
