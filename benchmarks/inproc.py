"""Single-process rows on the local disk: the floors, torch.save/load, DCP and ckptd.

One repetition runs every selected save-side system once (rotating the order each repetition),
then every read-side system once, each read preceded by a page-cache drop so that it is cold.
Systems that keep buffers across calls (ckptd, DCP with an explicit stager) get one untimed
warm-up call first; their first-call time is kept in the row's ``extra``.

What each time measures:

* ``floor.memcpy``: every tensor copied into buffers allocated (and touched) beforehand, the
  faster of two ways in each repetition: one ``copy_`` per tensor (OpenMP inside), and memcpy
  (``numpy.copyto``) in 8 MiB pieces on 4 threads (no parallel region per tensor: on a busy
  machine the first waits for descheduled OpenMP threads once per tensor);
* ``floor.write``: the same bytes written sequentially into one file, ``fsync`` of the file and
  its folder; ``floor.read``: that file read cold into the preallocated buffers;
* ``torch.save``: into a file, then fsync; ``torch.load``: cold, ``weights_only=True``;
* ``dcp.save``: ``FileSystemWriter(thread_count=4)``; ``dcp.load``: cold, into the live state
  dict, then ``set_state_dict`` (what a user restoring a model does);
* ``dcp.async_save.*``: ``block`` is the time until the snapshot is safe to mutate (the call's
  return for synchronous staging; ``staging_completion`` for asynchronous staging), ``commit``
  until the upload future resolves;
* ``ckptd.*``: ``block`` is ``Checkpointer.save``'s return, ``commit`` is ``fut.result()``,
  ``restore`` is ``Checkpointer.restore`` (cold), ``restore_inplace`` the same with ``in_place=True``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks import state as st
from benchmarks.common import (
    Timer,
    busy_ticks,
    collect,
    dcp_staged,
    drop_cache,
    fmt_bytes,
    fsync_dir,
    proc_ticks,
    remove,
    rotate,
    settle,
    stat_ticks,
    steal_ticks,
    vmstat_stalls,
)
from benchmarks.results import SKIPPED, Results

SECTION = "local"


@dataclass
class System:
    name: str
    phase: str  # "save" or "read"
    run: Callable[[int], None]
    warm: bool = False


def _write_all(fd: int, mv: memoryview) -> None:
    off = 0
    n = mv.nbytes
    while off < n:
        off += os.write(fd, mv[off : off + (256 << 20)])


def _read_all(fd: int, mv: memoryview) -> int:
    off = 0
    n = mv.nbytes
    while off < n:
        k = os.readv(fd, [mv[off : off + (256 << 20)]])
        if k == 0:
            break
        off += k
    return off


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def daemon_status() -> str | None:
    """None if ``ckptd serve`` and the trainer's daemon client are importable, else why not."""
    missing = []
    for m in ("ckptd.server", "trainer_hooks.daemon_sink"):
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except (ImportError, ValueError) as e:
            missing.append(f"{m} ({e})")
    if missing:
        return f"`ckptd serve` is not available yet: {', '.join(sorted(set(missing)))} not importable"
    return None


class Daemon:
    """A ``ckptd serve`` subprocess on a free loopback port, with its own staging folder, as the
    docs run it: a token file (the one ``CKPTD_TOKEN_FILE`` names, else a new one next to the log,
    which this process's trainers then read) and the trainers on its Unix socket (``socket_url``)."""

    def __init__(self, root: str, log_path: str, budget: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.dirname(root)
        self.staging = os.path.join(shm, f"ckptd-bench-{os.getpid()}-{self.port}")
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        if not os.environ.get("CKPTD_TOKEN_FILE"):
            token = f"{log_path}-token"
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            os.environ["CKPTD_TOKEN_FILE"] = token
        code = "import sys; from ckptd.cli.main import main; sys.exit(main())"
        args = ["serve", "--root", root, "--port", str(self.port), "--staging-dir", self.staging]
        args += ["--token-file", os.environ["CKPTD_TOKEN_FILE"]]
        args += ["--socket", f"{self.staging}/ckptd.sock"]  # not the machine's default socket
        self.socket_url = f"unix://{self.staging}/ckptd.sock"
        args += ["--budget", str(budget), "--log-level", "warning"]
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"ckptd serve exited with {self.proc.returncode}: {_tail(log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ckptd serve did not answer /healthz within 60 s: {_tail(log_path)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        remove(self.staging)


def _tail(path: str, n: int = 600) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip()
    except OSError:
        return ""


def run(
    res: Results,
    size: int,
    reps: int,
    bench_dir: str,
    selected: Callable[[str], bool],
    profile_prefix: str | None = None,
) -> None:
    """Build the state once and run every selected single-process system ``reps`` times."""
    from trainer_hooks import Checkpointer

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, optim, dims = st.build_local(size, seed=0)
    state = {"model": model, "optim": optim}
    tensors = st.all_tensors(model, optim)
    total = st.nbytes(tensors)
    res.sections.setdefault(SECTION, {}).update(
        {"state_bytes": total, "model": st.describe(dims), "tensors": len(tensors), "reps": reps}
    )
    bufs = [torch.empty_like(t) for t in tensors]
    for b in bufs:
        b.zero_()  # first touch outside any timing
    views = [_bytes_view(t) for t in tensors]
    buf_views = [_bytes_view(b) for b in bufs]
    sent = st.sentinel(model)
    ref = sent.detach().clone()
    failures: list[str] = []

    def path(name: str) -> str:
        return os.path.join(bench_dir, name)

    def check(name: str, got: torch.Tensor) -> None:
        if not torch.equal(got, ref):
            failures.append(f"{name}: restored values differ from the saved ones")

    def R(id, label, floor=None, dcp_ref=None, unit="s"):  # noqa: N802 - a short local constructor
        return res.row(id, SECTION, label, floor=floor, dcp=dcp_ref, unit=unit)

    R("floor.memcpy", "memcpy into preallocated buffers (snapshot floor)")
    R("floor.write", "raw sequential write + fsync (write floor)")
    R("floor.read", "raw cold read into preallocated buffers (read floor)")
    systems: list[System] = []

    # ---------------------------------------------------------------------------- floors
    def copy_into(dst: list[torch.Tensor]) -> float:
        with Timer() as t:
            for b, x in zip(dst, tensors, strict=True):
                b.copy_(x)
        return t.s

    copier = ThreadPoolExecutor(4, thread_name_prefix="floor-copy")

    def pieces_into(dst: list[torch.Tensor]) -> float:
        step = 8 << 20
        jobs = []
        for b, x in zip(dst, tensors, strict=True):
            bv, xv = _bytes_view(b), _bytes_view(x)
            jobs += [(bv[i : i + step], xv[i : i + step]) for i in range(0, len(bv), step)]

        def run(part) -> None:
            for d, s in part:
                np.copyto(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))

        with Timer() as t:
            for f in [copier.submit(run, jobs[i::4]) for i in range(4)]:
                f.result()
        return t.s

    def memcpy(rep: int, row: str = "floor.memcpy", dst: list[torch.Tensor] = bufs) -> None:
        u0 = _usage()
        by_copy = copy_into(dst)
        _record_usage(res.rows[row], u0)
        by_pieces = pieces_into(dst)
        res.rows[row].extra.setdefault("copy_s", []).append(round(by_copy, 4))
        res.rows[row].extra.setdefault("pieces_s", []).append(round(by_pieces, 4))
        res.add(row, rep, min(by_copy, by_pieces))

    # The same copy into buffers allocated where ckptd's snapshot buffers are: after the other
    # systems' first calls (DCP's fresh staging copies among them). Not a target's floor: it tells
    # whether a slow snapshot is ckptd's copy or the memory it was given (on this VM, memory
    # allocated after gigabytes were freed has faulted in about 5x slower, and copies into it
    # stayed slow).
    late: list[torch.Tensor] = []

    def memcpy_late(rep: int) -> None:
        if not late:
            late.extend(torch.empty_like(t) for t in tensors)
            res.rows["floor.memcpy_late"].extra["first_call_s"] = copy_into(late)
        if rep >= 0:
            memcpy(rep, "floor.memcpy_late", late)

    def raw_write(rep: int) -> None:
        p = path("raw.bin")
        remove(p)
        with Timer() as t:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for v in views:
                    _write_all(fd, v)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(bench_dir)
        res.add("floor.write", rep, t.s)

    def raw_read(rep: int) -> None:
        p = path("raw.bin")
        drop_cache(p)
        with Timer() as t:
            fd = os.open(p, os.O_RDONLY)
            try:
                got = sum(_read_all(fd, v) for v in buf_views)
            finally:
                os.close(fd)
        if got != total:
            failures.append(f"raw read got {got} of {total} bytes")
        res.add("floor.read", rep, t.s)

    if selected("floor"):
        systems += [System("floor.memcpy", "save", memcpy), System("floor.write", "save", raw_write)]
        systems += [System("floor.read", "read", raw_read)]

    # ---------------------------------------------------------------------- torch.save
    R("torch.save", "torch.save + fsync", floor="floor.write", dcp_ref="dcp.save")
    R("torch.load", "torch.load (cold)", floor="floor.read", dcp_ref="dcp.load")

    def torch_save(rep: int) -> None:
        p = path("torch.pt")
        remove(p)
        with Timer() as t:
            sd = st.dcp_state(model, optim)
            with open(p, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(bench_dir)
        res.add("torch.save", rep, t.s)

    def torch_load(rep: int) -> None:
        p = path("torch.pt")
        drop_cache(p)
        with Timer() as t:
            obj = torch.load(p, weights_only=True)
        res.add("torch.load", rep, t.s)
        check("torch.load", obj["model"]["ln_f.weight"])
        del obj

    if selected("torch"):
        systems += [System("torch.save", "save", torch_save), System("torch.load", "read", torch_load)]

    # ------------------------------------------------------------------------------ DCP
    R("dcp.save", "dcp.save (FileSystemWriter, thread_count=4)", floor="floor.write")
    R("dcp.load", "dcp.load (cold) + set_state_dict", floor="floor.read")

    def dcp_save(rep: int) -> None:
        for name in os.listdir(bench_dir):
            if name.startswith("dcp_save_"):
                remove(path(name))
        p = path(f"dcp_save_{rep}")
        u0 = _usage()
        with Timer() as t:
            sd = st.dcp_state(model, optim)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=4))
        res.add("dcp.save", rep, t.s)
        _record_cpu(res.rows["dcp.save"], u0)

    def dcp_load(rep: int) -> None:
        p = path(f"dcp_save_{rep}")
        if not os.path.isdir(p):
            return
        with torch.no_grad():
            sent.zero_()
        drop_cache(p)
        u0 = _usage()
        with Timer() as t:
            sd = st.dcp_state(model, optim)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(p))
            st.dcp_apply(model, optim, sd)
        _record_usage(res.rows["dcp.load"], u0)
        res.add("dcp.load", rep, t.s)
        check("dcp.load", sent.detach())

    if selected("dcp"):
        systems += [System("dcp.save", "save", dcp_save), System("dcp.load", "read", dcp_load)]

    # DCP async_save variants. Pinned memory needs CUDA: StateDictStager ignores it on CPU, and
    # FileSystemWriter(cache_staged_state_dict=True) fails there (it pins), so it is not offered.
    variants = {
        "default": ("dcp.async_save default (checkpoint_id only)", None),
        "sync_cached": (
            "dcp.async_save + DefaultStager(sync staging, cached buffers)",
            StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                           use_non_blocking_copy=False),
        ),
        "shm_cached": (
            "dcp.async_save + DefaultStager(sync staging, shared-memory cached buffers)",
            StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                           use_non_blocking_copy=False),
        ),
        "async_cached": (
            "dcp.async_save + DefaultStager(async staging, cached buffers): until staging is done",
            StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                           use_non_blocking_copy=False),
        ),
    }  # fmt: skip
    stagers: dict[str, DefaultStager] = {}

    def dcp_async(variant: str, opts) -> Callable[[int], None]:
        def go(rep: int) -> None:
            p = path(f"dcp_async_{variant}_{rep}")
            remove(p)
            if opts is not None and variant not in stagers:
                stagers[variant] = DefaultStager(opts)
            u0 = _usage()
            t0 = time.perf_counter()
            sd = st.dcp_state(model, optim)
            if opts is None:
                r = dcp.async_save(sd, checkpoint_id=p)
            else:
                w = dcp.FileSystemWriter(p, thread_count=4)
                r = dcp.async_save(sd, storage_writer=w, async_stager=stagers[variant])
            upload = dcp_staged(r)
            t_safe = time.perf_counter() - t0
            upload.result()
            t_commit = time.perf_counter() - t0
            remove(p)
            if rep < 0:
                res.rows[f"dcp.async.{variant}.block"].extra["first_call_s"] = t_safe
                return
            res.add(f"dcp.async.{variant}.block", rep, t_safe)
            res.add(f"dcp.async.{variant}.commit", rep, t_commit)
            _record_cpu(res.rows[f"dcp.async.{variant}.commit"], u0)

        return go

    for v, (label, opts) in variants.items():
        R(f"dcp.async.{v}.block", label + " -- until safe to mutate", floor="floor.memcpy",
          dcp_ref="dcp.async.default.block")  # fmt: skip
        R(f"dcp.async.{v}.commit", label + " -- until written", floor="floor.write", dcp_ref="dcp.save")
        if selected("dcp"):
            systems.append(System(f"dcp.async.{v}", "save", dcp_async(v, opts), warm=opts is not None))

    # ---------------------------------------------------------------------------- ckptd
    R("ckptd.block", "ckptd save: time save() blocks", floor="floor.memcpy", dcp_ref="dcp.async.default.block")
    R("ckptd.commit", "ckptd save: time until committed (fut.result())", floor="floor.write", dcp_ref="dcp.save")
    R("ckptd.restore", "ckptd restore (cold)", floor="floor.read", dcp_ref="dcp.load")
    R("ckptd.restore_inplace", "ckptd restore(in_place=True) (cold): DCP's semantics", floor="floor.read",
      dcp_ref="dcp.load")  # fmt: skip
    R("ckptd.keep1.block", "ckptd save, keep_last=1: time save() blocks", floor="floor.memcpy",
      dcp_ref="dcp.async.default.block")  # fmt: skip
    R("ckptd.keep1.commit", "ckptd save, keep_last=1 (retention runs before the future resolves): until committed",
      floor="floor.write", dcp_ref="dcp.save")  # fmt: skip
    ck_root = path("ckptd_job")
    ckpts: dict[str, Checkpointer] = {}
    step = {"local": 0, "keep1": 0, "daemon": 0}
    prefixes = {"local": "ckptd", "keep1": "ckptd.keep1", "daemon": "ckptd.daemon"}

    def ckptd_save(which: str) -> Callable[[int], None]:
        prefix = prefixes[which]

        def go(rep: int) -> None:
            ck = ckpts[which]
            step[which] += 1
            u0 = _usage()
            t0 = time.perf_counter()
            fut = ck.save(step[which], state)
            t_block = time.perf_counter() - t0
            u1 = _usage()
            result = fut.result()
            t_commit = time.perf_counter() - t0
            u_commit = _usage()
            if which != "keep1":
                _prune_older(ck, step[which])  # outside the timing: DCP deletes nothing either
            else:
                ck.wait_idle()  # its retention runs after the commit: keep it out of the next system's time
            if rep < 0:
                res.rows[f"{prefix}.block"].extra.update(first_call_s=t_block, first_commit_s=t_commit)
                return
            res.add(f"{prefix}.block", rep, t_block)
            res.add(f"{prefix}.commit", rep, t_commit)
            _record_cpu(res.rows[f"{prefix}.commit"], u0, u_commit)
            if getattr(result, "phases", None):  # the in-process writer's write / sync / commit split
                res.rows[f"{prefix}.commit"].extra.setdefault("phases", []).append(
                    {k: round(v, 4) for k, v in result.phases.items()}
                )
            res.rows[f"{prefix}.block"].extra.setdefault("reported_last_save_blocked_s", []).append(
                ck.last_save_blocked_s
            )
            _record_usage(res.rows[f"{prefix}.block"], u0, u1)
            res.rows[f"{prefix}.block"].extra.setdefault("phases", []).append(
                {k: round(v, 4) for k, v in getattr(ck, "last_save_phases", {}).items()}
            )
            res.rows[f"{prefix}.block"].extra["staged_bytes"] = ck.staged_bytes

        return go

    def ckptd_restore(in_place: bool) -> Callable[[int], None]:
        rid = "ckptd.restore_inplace" if in_place else "ckptd.restore"

        def go(rep: int) -> None:
            ck = ckpts["local"]
            with torch.no_grad():
                sent.zero_()
            drop_cache(ck_root)
            u0 = _usage()
            with Timer() as t:
                got = ck.restore(state, in_place=in_place)
            _record_usage(res.rows[rid], u0)  # page faults: fresh buffers; kswapd_s: memory pressure
            res.add(rid, rep, t.s)
            if got != step["local"]:
                failures.append(f"{rid} returned step {got}, expected {step['local']}")
            check(rid, sent.detach())

        return go

    # The same cold restores in a fresh process: how a job restarting after a preemption
    # restores (``fresh_restore``), with none of this process's history of freed gigabytes.
    R("ckptd.restore_fresh", "ckptd restore (cold) in a fresh process, as a restarting job", floor="floor.read",
      dcp_ref="dcp.load_fresh")  # fmt: skip
    R("dcp.load_fresh", "dcp.load (cold) + set_state_dict in a fresh process", floor="floor.read")
    # ... and with the library's import in front, its files cold too (torch itself imported
    # before, warm): what a restarting job waits for between torch and its first step.
    R("ckptd.import_restore_fresh", "import trainer_hooks + ckptd restore, both cold, in a fresh process",
      dcp_ref="dcp.import_load_fresh")  # fmt: skip
    R("dcp.import_load_fresh", "import torch.distributed.checkpoint + dcp.load, both cold, in a fresh process")
    ref_path = path("sentinel.pt")
    torch.save(ref, ref_path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code: dict[str, list[str]] = {}  # the files each system's import reads, evicted before its child

    def fresh_restore(system: str, rid: str) -> Callable[[int], None]:
        def go(rep: int) -> None:
            p = ck_root if system == "ckptd" else path(f"dcp_save_{rep}")
            if not os.path.isdir(p):
                return
            if system not in code:
                cmd = [sys.executable, "-m", "benchmarks.fresh_restore", "--imports", system]
                code[system] = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300).stdout.split()
            drop_cache(p, *code[system])
            cmd = [sys.executable, "-m", "benchmarks.fresh_restore", system, p, str(size), ref_path]
            out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
            lines = out.stdout.strip().splitlines()
            if out.returncode != 0 or not lines:
                failures.append(f"{rid}: the fresh process failed ({out.returncode}): {out.stderr[-2000:]}")
                return
            got = json.loads(lines[-1])
            res.add(rid, rep, got["s"])
            res.add(rid.replace(".restore_", ".import_restore_").replace(".load_", ".import_load_"), rep,
                    got["import_s"] + got["s"])  # fmt: skip
            for k in ("page_faults", "cpu_s"):
                res.rows[rid].extra.setdefault(k, []).append(got[k])
            if not got["ok"]:
                failures.append(f"{rid}: restored values differ from the saved ones")

        return go

    if selected("dcp"):
        systems.append(System("dcp.load_fresh", "read", fresh_restore("dcp", "dcp.load_fresh")))

    if selected("ckptd"):
        systems.append(System("ckptd.restore_fresh", "read", fresh_restore("ckptd", "ckptd.restore_fresh")))
        ckpts["local"] = Checkpointer(ck_root)
        ckpts["keep1"] = Checkpointer(path("ckptd_keep1"), keep_last=1)
        systems += [System("ckptd.save", "save", ckptd_save("local"), warm=True)]
        systems += [System("ckptd.keep1", "save", ckptd_save("keep1"), warm=True)]
        systems += [System("ckptd.restore", "read", ckptd_restore(False))]
        systems += [System("ckptd.restore_inplace", "read", ckptd_restore(True))]

    # ckptd through the daemon
    R("ckptd.daemon.block", "ckptd via `ckptd serve`: time save() blocks", floor="floor.memcpy",
      dcp_ref="dcp.async.default.block")  # fmt: skip
    R("ckptd.daemon.commit", "ckptd via `ckptd serve`: time until committed", floor="floor.write", dcp_ref="dcp.save")
    daemon = None
    if selected("daemon"):
        why = daemon_status()
        if why is None:
            try:
                daemon = Daemon(path("daemon_job"), path("daemon.log"), budget=3 * total + (256 << 20))
                ckpts["daemon"] = Checkpointer(path("daemon_job"), daemon=daemon.socket_url)
                systems.append(System("ckptd.daemon", "save", ckptd_save("daemon"), warm=True))
            except Exception as e:  # noqa: BLE001 - any failure of a component still being built
                why = f"`ckptd serve` did not work: {type(e).__name__}: {e}"
                if daemon is not None:
                    daemon.stop()
                    daemon = None
        if why is not None:
            for k in ("block", "commit"):
                res.rows[f"ckptd.daemon.{k}"].status = SKIPPED
                res.rows[f"ckptd.daemon.{k}"].note = why
    else:
        for k in ("block", "commit"):
            res.rows[f"ckptd.daemon.{k}"].status = SKIPPED
            res.rows[f"ckptd.daemon.{k}"].note = "not selected (--only)"

    if selected("floor"):
        R("floor.memcpy_late", "the memcpy floor into buffers allocated after every system's first call "
          "(where ckptd's buffers are allocated; a diagnostic, no target)")  # fmt: skip
        systems.append(System("floor.memcpy_late", "save", memcpy_late, warm=True))

    # ------------------------------------------------------------------------------ run
    try:
        for s in systems:
            if s.warm and s.phase == "save":
                s.run(-1)
                collect()
        saves = [s for s in systems if s.phase == "save"]
        reads = [s for s in systems if s.phase == "read"]
        waits = res.sections[SECTION].setdefault("settle_s", {})
        for rep in range(reps):
            for phase in (saves, reads):
                for s in rotate(phase, rep):
                    waits.setdefault(s.name, []).append(round(settle(), 2))
                    s.run(rep)
                    collect()
            res.sections[SECTION]["last_rep_done"] = rep
        if profile_prefix and "local" in ckpts:
            _profile_ckptd(res, ckpts["local"], ckpts.get("keep1"), state, step, ck_root, profile_prefix)
    finally:
        for ck in ckpts.values():
            with contextlib.suppress(Exception):
                ck.close()
        for sg in stagers.values():
            sg.close()
        if daemon is not None:
            daemon.stop()
        for name in os.listdir(bench_dir):
            remove(path(name))
    res.sections[SECTION]["failures"] = failures
    res.sections[SECTION]["state"] = fmt_bytes(total)
    res.sections[SECTION]["cache_drop"] = drop_cache.method


def _usage() -> tuple[int, float, int, dict[int, int], int, int, dict[int, tuple[str, int]], dict[str, int]]:
    """This process's page faults (minor + major), CPU seconds (every thread), involuntary
    context switches and per-thread CPU ticks so far. Around a copy: faults mean unmapped
    buffers, CPU well under 2x the wall time of a 2-thread copy means it waited, involuntary
    switches that it was preempted, the per-thread ticks say which threads were busy, the
    machine's steal time whether the hypervisor ran someone else on our CPUs, and the vmstat
    stall counters whether allocations waited for reclaim or compaction (memory pressure)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return (
        r.ru_minflt + r.ru_majflt,
        r.ru_utime + r.ru_stime,
        r.ru_nivcsw,
        _thread_ticks(),
        steal_ticks(),
        busy_ticks(),
        proc_ticks(),
        vmstat_stalls(),
    )


def _thread_ticks() -> dict[int, int]:
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            got = stat_ticks(f"/proc/self/task/{tid}/stat")
            if got is not None:
                out[int(tid)] = got[1]
    return out


def _record_cpu(row, u0, u1=None) -> None:
    """CPU seconds this process (every thread) spent from the call to durable: what a save
    takes from training besides its wall time (a daemon's CPU is not in it)."""
    row.extra.setdefault("cpu_s", []).append(round((u1 or _usage())[1] - u0[1], 4))


def _record_usage(row, u0, u1=None) -> None:
    import threading

    u1 = u1 or _usage()
    row.extra.setdefault("page_faults", []).append(u1[0] - u0[0])
    _record_cpu(row, u0, u1)
    row.extra.setdefault("involuntary_switches", []).append(u1[2] - u0[2])
    names = {t.native_id: t.name for t in threading.enumerate()}
    hz = os.sysconf("SC_CLK_TCK")
    row.extra.setdefault("steal_s", []).append(round((u1[4] - u0[4]) / hz, 3))
    # CPU that ran on this machine outside this process meanwhile (a 2-core VM: it competes with
    # the copy's two threads), and how much of it was page reclaim (kswapd)
    row.extra.setdefault("outside_cpu_s", []).append(round((u1[5] - u0[5]) / hz - (u1[1] - u0[1]), 3))
    # ... and which processes ran it (kernel threads included: kworker, kdamond, jbd2, a daemon)
    others = sorted(((t - u0[6].get(pid, (comm, 0))[1], comm) for pid, (comm, t) in u1[6].items()), reverse=True)
    kswapd = sum(d for d, comm in others if comm.startswith("kswapd"))
    row.extra.setdefault("kswapd_s", []).append(round(kswapd / hz, 3))
    stalls = {k: v - u0[7].get(k, 0) for k, v in u1[7].items()}
    row.extra.setdefault("vm_stalls", []).append({k: d for k, d in stalls.items() if d})
    row.extra.setdefault("outside_top", []).append({comm: round(d / hz, 3) for d, comm in others[:3] if d > 0})
    busy = sorted(((t - u0[3].get(tid, 0), tid) for tid, t in u1[3].items()), reverse=True)[:3]
    row.extra.setdefault("busiest_threads", []).append(
        {names.get(tid, f"tid {tid} (no Python thread)"): round(d / hz, 3) for d, tid in busy if d > 0}
    )


def _prune_older(ck, latest: int) -> None:
    """Delete this job's checkpoints older than ``latest`` (untimed; keeps the disk from filling)."""
    from ckptd import catalog

    for s in catalog.steps(ck.store):
        if s < latest:
            catalog.delete_checkpoint(ck.store, s)


def _profile_ckptd(res: Results, ck, keep1, state, step: dict, root: str, prefix: str) -> None:
    """Profiles of ckptd's save (pyinstrument over the ``save`` calls alone: exactly what blocks
    training; py-spy over save + commit, every thread) and of a cold restore."""
    from benchmarks.profiling import profiled

    profs = res.sections[SECTION].setdefault("profiles", {})
    try:
        from pyinstrument import Profiler

        p = Profiler(interval=0.001)
        for _ in range(3):
            step["local"] += 1
            p.start()
            fut = ck.save(step["local"], state)
            p.stop()
            fut.result()
        path = prefix + "_save_block.txt"
        with open(path, "w") as f:
            f.write("# pyinstrument: 3 x Checkpointer.save() on the training thread (the time save blocks)\n\n")
            f.write(p.output_text(unicode=False, color=False))
        profs["save_block"] = {"tool": "pyinstrument", "summary": path, "top": []}
    except ImportError:
        pass
    with profiled(prefix + "_save", "ckptd in-process save x2 on local disk: save() (MainThread) + commit") as p:
        for _ in range(2):
            step["local"] += 1
            ck.save(step["local"], state).result()
    profs["save"] = p
    _prune_older(ck, step["local"])
    if keep1 is not None:
        with profiled(prefix + "_save_keep1", "ckptd save x2, keep_last=1: retention inside the commit") as p:
            for _ in range(2):
                step["keep1"] += 1
                keep1.save(step["keep1"], state).result()
        profs["save_keep1"] = p
        keep1.wait_idle()  # its retention runs after the commit: not during the restore profiled next
    drop_cache(root)
    with profiled(prefix + "_restore", "ckptd in-process restore, cold, local disk") as p:
        ck.restore(state)
    profs["restore"] = p
