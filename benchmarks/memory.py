"""Host memory of in-process async saves across many consecutive saves.

Each system runs in a fresh process (``python -m benchmarks.memory SYSTEM JSON``) so that no
other row's allocations pollute its RSS. The baseline is the RSS once the model and optimizer
state exist and the saving library is imported and its saver constructed (a start-up cost that
does not depend on the state, recorded as ``setup``); then, for every save, the RSS when
``save`` returns, when it is committed, and the peak in between (a thread samples
/proc/self/statm every 2 ms). The figure is the peak RSS above the baseline divided by the
state's bytes (target <= 1x), and its growth between the second and the last save (target:
flat).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import rss
from benchmarks.results import ERROR, Results

SECTION = "memory"
SYSTEMS = {
    "ckptd": "ckptd Checkpointer.save (in-process background writer)",
    "dcp_default": "dcp.async_save default (a fresh staging copy per call)",
    "dcp_cached": "dcp.async_save + DefaultStager(sync, cached buffers)",
}


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def take(self) -> int:
        p, self.peak = max(self.peak, rss()), 0
        return p

    def stop(self) -> None:
        self._stop.set()


def worker(system: str, size: int, saves: int, dir: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from benchmarks import state as st

    model, optim, _ = st.build_local(size, seed=4)
    state = {"model": model, "optim": optim}
    total = st.nbytes(st.all_tensors(model, optim))
    gc.collect()
    before_setup = rss()
    # The baseline is taken once the library is imported and its saver constructed (threads
    # not yet started): those are paid once at start-up, whatever the state's size; the figure is what
    # saving adds on top. ``setup_rss`` (recorded) is that start-up cost.
    if system == "ckptd":
        from trainer_hooks import Checkpointer

        ck = Checkpointer(os.path.join(dir, "job"), keep_last=1)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False)) if system == "dcp_cached" else None
    gc.collect()
    base = rss()
    sampler = Sampler()
    sampler.start()
    after_save, after_commit, peaks, times = [], [], [], []
    staged = None
    if system == "ckptd":
        fut = None
        for i in range(saves):
            t0 = time.perf_counter()
            fut = ck.save(i + 1, state)  # waits for the previous save, as in training
            times.append(time.perf_counter() - t0)
            after_save.append(rss())
            _train_step(model)
            fut.result()
            after_commit.append(rss())
            peaks.append(sampler.take())
        staged = ck.staged_bytes
        ck.close()
    else:
        prev = None
        for i in range(saves):
            p = os.path.join(dir, f"dcp_{i}")
            t0 = time.perf_counter()
            if prev is not None:
                prev.result()
            if stager is None:
                fut = dcp.async_save(st.dcp_state(model, optim), checkpoint_id=p)
            else:
                fut = dcp.async_save(
                    st.dcp_state(model, optim), storage_writer=dcp.FileSystemWriter(p, thread_count=4),
                    async_stager=stager,
                )  # fmt: skip
            times.append(time.perf_counter() - t0)
            after_save.append(rss())
            _train_step(model)
            fut.result()
            after_commit.append(rss())
            peaks.append(sampler.take())
            prev = fut
            old = os.path.join(dir, f"dcp_{i - 1}")
            if os.path.isdir(old):
                import shutil

                shutil.rmtree(old, ignore_errors=True)
        if stager is not None:
            stager.close()
    sampler.stop()
    del torch
    return {
        "system": system,
        "state_bytes": total,
        "baseline_rss": base,
        "setup_rss": base - before_setup,
        "staged_bytes": staged,
        "after_save": after_save,
        "after_commit": after_commit,
        "peaks": peaks,
        "block_s": times,
    }


def _train_step(model) -> None:
    """A stand-in for training between saves: the parameters change in place."""
    import torch

    with torch.no_grad():
        model.ln_f.weight.add_(1.0)


def run(res: Results, size: int, saves: int, bench_dir: str, systems=("ckptd", "dcp_default")) -> None:
    from benchmarks.common import fmt_bytes

    sec = res.sections.setdefault(SECTION, {"saves": saves, "curves": {}})
    for system in systems:
        rid = f"memory.{system}"
        r = res.row(rid, SECTION, f"{SYSTEMS[system]}: peak RSS above baseline / state", unit="x")
        g = res.row(rid + ".growth", SECTION, f"{SYSTEMS[system]}: RSS growth, save 2 -> {saves}, / state", unit="x")
        # tmpfs when there is one: the RSS of the saving process does not depend on the medium
        # (tmpfs pages are not mapped into it), and 50 saves on a slow disk take minutes
        scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else bench_dir
        d = os.path.join(scratch, f"ckptd-bench-mem-{os.getpid()}-{system}")
        os.makedirs(d, exist_ok=True)
        out = Path(bench_dir) / f"mem_{system}.json"
        args = json.dumps({"system": system, "size": size, "saves": saves, "dir": d, "out": str(out)})
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", args], capture_output=True, text=True, env=env, timeout=1800
        )
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        if p.returncode != 0 or not out.exists():
            r.status = g.status = ERROR
            r.note = g.note = f"worker failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}"
            continue
        data = json.loads(out.read_text())
        out.unlink()
        s, base = data["state_bytes"], data["baseline_rss"]
        extra = [(pk - base) / s for pk in data["peaks"]]
        for i, x in enumerate(extra):
            res.add(rid, i, x)
        growth = (data["after_commit"][-1] - data["after_commit"][1]) / s if len(data["after_commit"]) > 1 else 0.0
        res.add(rid + ".growth", 0, growth)
        r.extra.update(
            max=max(extra),
            state=fmt_bytes(s),
            baseline=fmt_bytes(base),
            setup=fmt_bytes(data["setup_rss"]),
            max_with_setup=max(extra) + data["setup_rss"] / s,
        )
        if data.get("staged_bytes") is not None:
            r.extra["staged_over_state"] = data["staged_bytes"] / s
        sec["curves"][system] = data
        sec["medium"] = scratch
        sec["state_bytes"] = s


def main() -> None:
    args = json.loads(sys.argv[1])
    out = args.pop("out")
    Path(out).write_text(json.dumps(worker(**args)))


if __name__ == "__main__":
    main()
