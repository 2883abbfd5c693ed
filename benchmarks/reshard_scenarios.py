"""What each rank does in the resharding rows (run by ``benchmarks.dist``): save an FSDP2 state at
N ranks with ckptd, DCP and the raw floor, then restore it at M ranks.

Every timed operation is bracketed by barriers, so its time is the job's (the slowest rank's).
Before each restore, rank 0 drops the page cache (between barriers) so every read is cold, and
each rank records the delta of its ``/proc/self/io``, the same measure for all three systems:
``rchar`` (bytes read()/pread() returned to the rank: what it fetched, as it would over a network
from its own host) is the figure, divided by the bytes the rank restores; ``read_bytes`` (what the
block layer read for it) is kept too, but the ranks here share one page cache, so bytes that two
ranks both read are counted once there. Every system runs once untimed first, so lazy imports
do not land in the first repetition's counters.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks import state as st
from benchmarks.common import drop_cache, proc_io, remove, rotate

warnings.filterwarnings("ignore")


def _barrier() -> None:
    dist.barrier()


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn) -> float:
    """Run ``fn`` on every rank between barriers; the job's wall time."""
    _barrier()
    t0 = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - t0


def _views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]


def _checksum(model) -> float:
    """A value that differs unless the restore brought back what was saved (sum over ranks)."""
    t = torch.tensor([float(st._local(model.emb.weight).double().sum())], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def save(size: int, dir: str, reps: int, out: str) -> dict:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from trainer_hooks import Checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, dims = st.build_fsdp(size, seed=1)
    state = {"model": model, "optim": optim}
    tensors = st.all_tensors(model, optim)
    local = st.nbytes(tensors)
    views = _views(tensors)
    raw_dir = os.path.join(dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    ck = Checkpointer(os.path.join(dir, "ckptd_job"))
    step = [0]
    times: dict[str, list] = {"raw": [], "ckptd.block": [], "ckptd.commit": [], "dcp.save": []}

    def raw(rep: int) -> None:
        p = os.path.join(raw_dir, f"rank{rank}.bin")
        remove(p)

        def go() -> None:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for v in views:
                    off = 0
                    while off < v.nbytes:
                        off += os.write(fd, v[off : off + (256 << 20)])
                os.fsync(fd)
            finally:
                os.close(fd)

        times["raw"].append(_timed(go))

    def ckptd(rep: int) -> None:
        step[0] += 1
        block = [0.0]

        def go() -> None:
            t0 = time.perf_counter()
            fut = ck.save(step[0], state)
            block[0] = time.perf_counter() - t0
            fut.result()

        t = _timed(go)
        if rank == 0:  # untimed: DCP deletes nothing either
            from ckptd import catalog

            for s in catalog.steps(ck.store):
                if s < step[0]:
                    catalog.delete_checkpoint(ck.store, s)
        _barrier()
        if rep >= 0:
            times["ckptd.block"].append(_max(block[0]))
            times["ckptd.commit"].append(t)

    def dcp(rep: int) -> None:
        if rank == 0:
            for name in os.listdir(dir):
                if name.startswith("dcp_"):
                    remove(os.path.join(dir, name))
        p = os.path.join(dir, f"dcp_{rep}")

        def go() -> None:
            sd = st.dcp_state(model, optim)
            dcp_save(sd, storage_writer=FileSystemWriter(p, thread_count=4))

        times["dcp.save"].append(_timed(go))

    ckptd(-1)  # warm-up: allocates ckptd's reusable snapshot buffers
    systems = [raw, ckptd, dcp]
    for rep in range(reps):
        for s in rotate(systems, rep):
            s(rep)
    ck.close()
    return {
        "rank": rank,
        "world": world,
        "local_bytes": local,
        "raw_bytes": sum(v.nbytes for v in views),
        "times": times,
        "dcp_dir": os.path.join(dir, f"dcp_{reps - 1}"),
        "checksum": _checksum(model),
        "model": st.describe(dims),
    }


def restore(size: int, dir: str, reps: int, out: str, dcp_dir: str, raw_sizes: list[int], profile: str = "") -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from trainer_hooks import Checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, _ = st.build_fsdp(size, seed=2)
    state = {"model": model, "optim": optim}
    local = st.nbytes(st.all_tensors(model, optim))
    ck = Checkpointer(os.path.join(dir, "ckptd_job"))

    # The raw floor: this rank's 1/M of the bytes the N saving ranks wrote, read cold.
    total = sum(raw_sizes)
    lo, hi = rank * total // world, (rank + 1) * total // world
    buf = torch.zeros(hi - lo, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    files = [os.path.join(dir, "raw", f"rank{r}.bin") for r in range(len(raw_sizes))]

    def raw() -> None:
        pos, out_off = 0, 0
        for f, n in zip(files, raw_sizes, strict=True):
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                fd = os.open(f, os.O_RDONLY)
                try:
                    got = 0
                    while got < b - a:
                        k = os.preadv(fd, [mv[out_off + got : out_off + b - a]], a - pos + got)
                        if k == 0:
                            raise RuntimeError(f"short read of {f}")
                        got += k
                finally:
                    os.close(fd)
                out_off += b - a
            pos += n

    def ckptd() -> None:
        ck.restore(state)

    def ckptd_inplace() -> None:
        ck.restore(state, in_place=True)

    def dcp() -> None:
        sd = st.dcp_state(model, optim)
        dcp_load(sd, storage_reader=FileSystemReader(dcp_dir))
        st.dcp_apply(model, optim, sd)

    systems = {
        "raw": (raw, hi - lo),
        "ckptd": (ckptd, local),
        "ckptd_inplace": (ckptd_inplace, local),
        "dcp": (dcp, local),
    }
    rows: dict[str, list] = {k: [] for k in systems}
    checks: dict[str, float] = {}
    for fn, _ in systems.values():  # warm-up: imports, first-use allocations
        _timed(fn)
    for rep in range(reps):
        for name in rotate(list(systems), rep):
            fn, restored = systems[name]
            _barrier()
            if rank == 0:
                drop_cache(dir)
            _barrier()
            io0 = proc_io()
            t = _timed(fn)
            io1 = proc_io()
            rows[name].append(
                {
                    "time": t,
                    "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
                    "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
                    "restored": restored,
                }
            )
            if name != "raw":
                checks[name] = _checksum(model)
                with torch.no_grad():  # so the next restore must bring the values back again
                    st._local(model.emb.weight).zero_()
    prof = None
    if profile:
        from benchmarks.profiling import profiled

        _barrier()
        if rank == 0:
            drop_cache(dir)
        _barrier()
        if rank == 0:
            with profiled(profile, f"ckptd restore at {world} ranks (rank 0), cold") as prof:
                ckptd()
                _barrier()
        else:
            ckptd()
            _barrier()
    ck.close()
    return {"rank": rank, "world": world, "local_bytes": local, "rows": rows, "checks": checks, "profile": prof}
