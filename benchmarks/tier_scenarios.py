"""What each rank does in the tiers rows at M > 1 restoring ranks (run by ``benchmarks.dist``):
``save`` an FSDP2 state at M ranks through daemon ``a`` (its hot copy is replicated to ``b``), to
an S3 root and with ``dcp.save``; then, after the parent SIGKILLed ``a``, ``restore`` it at M
ranks all on node ``c``: from the peer's memory (through ``c``), from the local-disk root, from
S3 and with ``dcp.load``, interleaved per repetition. Every timed restore is bracketed by
barriers, so its time is the job's (the slowest rank's)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from benchmarks import state as st
from benchmarks.common import collect, rotate

warnings.filterwarnings("ignore")


def _checksum(model) -> float:
    return float(sum(st._local(p).double().sum() for p in model.parameters()))


def save(size: int, out: str, disk_root: str, s3_root: str, dcp_dir: str, daemon: str) -> dict:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from trainer_hooks import Checkpointer

    model, optim, _ = st.build_fsdp(size, seed=5)
    state = {"model": model, "optim": optim}
    with Checkpointer(disk_root, daemon=daemon) as ck:
        ck.save(1, state).result()
    with Checkpointer(s3_root) as ck:
        ck.save(1, state).result()
    dcp_save(st.dcp_state(model, optim), storage_writer=FileSystemWriter(dcp_dir))
    return {"checksum": _checksum(model)}


def restore(size: int, out: str, disk_root: str, s3_root: str, dcp_dir: str, daemon: str, reps: int) -> dict:
    import time

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from trainer_hooks import Checkpointer

    model, optim, _ = st.build_fsdp(size, seed=6)
    state = {"model": model, "optim": optim}
    cks = {"peer": Checkpointer(disk_root, daemon=daemon), "disk": Checkpointer(disk_root), "s3": Checkpointer(s3_root)}
    tiers: dict = {}

    def ckptd(name: str):
        def go() -> None:
            cks[name].restore(state)
            if name == "peer":
                tiers.update(cks[name].last_restore_tiers)

        return go

    def dcp() -> None:
        sd = st.dcp_state(model, optim)
        dcp_load(sd, storage_reader=FileSystemReader(dcp_dir))
        st.dcp_apply(model, optim, sd)

    systems = {"peer": ckptd("peer"), "disk": ckptd("disk"), "s3": ckptd("s3"), "dcp": dcp}
    times: dict[str, list[float]] = {k: [] for k in systems}
    checks: dict[str, float] = {}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for fn in systems.values():  # warm-up: connections, page cache, first-use allocations
        timed(fn)
    for rep in range(reps):
        for name in rotate(list(systems), rep):
            with torch.no_grad():  # so the restore must bring the values back
                st._local(model.emb.weight).zero_()
            times[name].append(timed(systems[name]))
            checks[name] = _checksum(model)
            collect()
    for ck in cks.values():
        ck.close()
    return {"times": times, "checks": checks, "tiers": tiers}


def memsteps(size: int, out: str, hot_root: str, mem_root: str, daemon: str, reps: int) -> dict:
    """The memory-only step rows: through this node's ``daemon``, save the state as committed
    step 1 in ``hot_root`` (its hot copy stays in the daemon), and in ``mem_root`` as step 2
    (persisted) then step 3 with ``persist_every=2`` (memory-only: only in the daemon). Then
    restore both, interleaved per repetition, each into zeroed tensors and checked bitwise
    against the saved values (every tensor of this rank). Two roots: a restore fences away the
    memory-only steps newer than the one it restored, so step 3 cannot share a root with the
    committed step restored beside it."""
    import time

    from trainer_hooks import Checkpointer

    model, optim, _ = st.build_fsdp(size, seed=7)
    state = {"model": model, "optim": optim}
    tensors = st.all_tensors(model, optim)
    with Checkpointer(hot_root, daemon=daemon) as ck:
        ck.save(1, state).result()
    with Checkpointer(mem_root, daemon=daemon, persist_every=2) as ck:
        ck.save(2, state).result()
        ck.save(3, state).result()
    ref = [t.clone() for t in tensors]
    cks = {"hot": Checkpointer(hot_root, daemon=daemon), "memonly": Checkpointer(mem_root, daemon=daemon)}
    times: dict[str, list[float]] = {k: [] for k in cks}
    checks: dict[str, int] = {}
    tiers: dict[str, dict] = {}
    steps: dict[str, int | None] = {}

    def timed(name: str) -> float:
        with torch.no_grad():  # so the restore must bring every value back
            for t in tensors:
                t.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        steps[name] = cks[name].restore(state)
        dist.barrier()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        tiers[name] = cks[name].last_restore_tiers
        checks[name] = min(checks.get(name, 1), int(all(torch.equal(a, b) for a, b in zip(tensors, ref, strict=True))))
        return float(t.item())

    for name in cks:  # warm-up: connections, mappings, first-use allocations
        timed(name)
    for rep in range(reps):
        for name in rotate(list(cks), rep):
            times[name].append(timed(name))
            collect()
    for ck in cks.values():
        ck.close()
    return {"times": times, "checks": checks, "tiers": tiers, "steps": steps}
