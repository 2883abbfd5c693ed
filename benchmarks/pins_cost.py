"""What pins cost and save (issue 26 part 1, issue 31 item 2), measured on the real code:

* the commit's shard check: CPU seconds to compare the done tree's shard digest with the
  manifest's, at A arrays x N ranks (each array one shard per rank, as FSDP saves it), before
  (``expected_shards`` + a sha256 sum over every shard key, the check up to issue 26) and after
  (``commit.expected_digest``, O(arrays));
* a restore's extra requests: the LISTs and GETs of done records one restoring rank makes to
  load the pins of the shards it reads (``restore.pins_for`` against a counting in-memory
  store holding N done records), for a save at N ranks restored at M;
* BLAKE3 pins (issue 36 item 3): save-to-commit and restore of one rank's state with the done
  records pinning each part's crc32c only (as before issue 36: the writer's digests switched
  off) and with each part's BLAKE3 too, side by side, alternating, the median of ``--reps``; with
  the load average and the CPU seconds of the hashing alone (``hash_cpu_s``).

Run: ``python -m benchmarks.pins_cost [--arrays 300 900] [--ranks 4096] [--restore-at 1024 4096]``;
the BLAKE3 rows alone: ``python -m benchmarks.pins_cost --blake3 256MiB 1.5GiB [--dir /dev/shm]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock

import numpy as np

from ckptd import commit, donetree
from ckptd import manifest as mf
from ckptd.codec import crc32c, part_digest
from ckptd.layout import Box, plan_grid
from ckptd.reader import ReadRequest
from storage_backends.memory import MemoryStore


def _fsdp(shape, n):
    step = -(-shape[0] // n)
    return [Box((min(r * step, shape[0]), 0), (min((r + 1) * step, shape[0]), shape[1])) for r in range(n)]


def manifest(arrays: int, ranks: int) -> mf.Manifest:
    shape = (ranks * 256, 256)  # 256 KiB per rank and array: one shard each
    grid = plan_grid(shape, 4, "float32", _fsdp(shape, ranks))
    tensors = {}
    for i in range(arrays):
        key = f"model/layers.{i}.weight"
        tensors[key] = mf.TensorEntry(key, grid.layout, writers=grid.writer_runs(key))
    return mf.Manifest(1, ranks, tensors, {}, "a")


def _old_digest(keys) -> int:
    return sum(int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") for k in keys) & ((1 << 64) - 1)


def commit_check(arrays: int, ranks: int) -> dict:
    m = manifest(arrays, ranks)
    t = time.process_time()
    _old_digest(commit.expected_shards(m))
    before = time.process_time() - t
    t = time.process_time()
    commit.expected_digest(m)
    after = time.process_time() - t
    return {"arrays": arrays, "ranks": ranks, "before_cpu_s": round(before, 3), "after_cpu_s": round(after, 6)}


class CountingStore(MemoryStore):
    def __init__(self, uri):
        super().__init__(uri)
        self.gets = self.lists = 0

    def get(self, key, limit=None):
        self.gets += 1
        return super().get(key, limit)

    def list(self, prefix=""):
        self.lists += 1
        return super().list(prefix)


def restore_requests(arrays: int, ranks: int, restore_at: int, rank: int) -> dict:
    from trainer_hooks.restore import pins_for

    m = manifest(arrays, ranks)
    m.pinned = True
    store = CountingStore(f"memory://pins-{arrays}-{ranks}-{restore_at}")
    for r in range(ranks):
        rec = {"rank": r, "bytes": 0, "objects": 0, "shards": [], "pins": donetree.make_pins({}, {})}
        store.put(donetree.record_key(1, "a", r, rec), json.dumps(rec).encode())
    store.gets = store.lists = 0
    shape = next(iter(m.tensors.values())).layout.shape
    box = _fsdp(shape, restore_at)[rank]
    requests = [ReadRequest(e, box, np.empty(box.shape, np.float32)) for e in m.tensors.values()]
    pins_for(store, m, 1, "bench", None, requests)
    return {
        "arrays": arrays,
        "saved_at": ranks,
        "restored_at": restore_at,
        "rank": rank,
        "done_record_gets": store.gets,
        "lists": store.lists,
    }


def _state(nbytes: int) -> dict:
    import torch

    n = 16 << 20  # 64 MiB tensors of float32
    sizes = [n] * (nbytes // 4 // n) + ([nbytes // 4 % n] if nbytes // 4 % n else [])
    return {f"layers.{i}.weight": torch.rand(k // 1024, 1024) for i, k in enumerate(sizes)}


def blake3_cost(nbytes: int, reps: int, folder: str | None = None) -> dict:
    """Seconds (wall, and CPU of this process) to save to commit and to restore ``nbytes`` of
    float32 tensors into a local root under ``folder``, with crc32c-only pins and with BLAKE3
    pins; the medians and their ratios (BLAKE3 / crc32c)."""
    import torch

    from ckptd import persist
    from trainer_hooks import Checkpointer

    state = _state(nbytes)
    got = {k: torch.empty_like(v) for k, v in state.items()}
    load = round(os.getloadavg()[0], 2)  # 1-minute load average when the row began, and ended
    kinds = ("save", "restore", "save_cpu", "restore_cpu")
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in kinds} for m in ("crc32c", "blake3")}
    for rep in range(-1, reps):  # rep -1 warms up (imports, page faults, thread pools): not counted
        for mode in ("crc32c", "blake3") if rep % 2 == 0 else ("blake3", "crc32c"):
            root = tempfile.mkdtemp(prefix=f"pins-{mode}-", dir=folder)
            try:
                with contextlib.ExitStack() as es:
                    if mode == "crc32c":  # the done records a writer made before issue 36
                        es.enter_context(mock.patch.object(persist, "shard_digests", lambda bufs: None))
                        es.enter_context(mock.patch.object(persist, "image_digests", lambda *a: None))
                    ck = es.enter_context(Checkpointer(root))
                    t, c = time.perf_counter(), time.process_time()
                    ck.save(1, state).result()
                    if rep >= 0:
                        times[mode]["save"].append(time.perf_counter() - t)
                        times[mode]["save_cpu"].append(time.process_time() - c)
                with Checkpointer(root) as ck:
                    t, c = time.perf_counter(), time.process_time()
                    ck.restore(got, step=1)
                    if rep >= 0:
                        times[mode]["restore"].append(time.perf_counter() - t)
                        times[mode]["restore_cpu"].append(time.process_time() - c)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    out = {"bytes": nbytes, "reps": reps, "load": [load, round(os.getloadavg()[0], 2)]}
    for k in kinds:  # wall seconds, and CPU seconds of the process (all its threads): steadier on a busy host
        out[f"{k}_crc32c_s"] = round(med["crc32c"][k], 3)
        out[f"{k}_blake3_s"] = round(med["blake3"][k], 3)
        out[f"{k}_ratio"] = round(med["blake3"][k] / med["crc32c"][k], 3)
    # The pins' own work: BLAKE3 over the same bytes in 2 MiB parts on one thread. Where a save is
    # CPU-bound (every core busy throughout), its wall ratio cannot fall below
    # 1 + hash / (the crc32c save's CPU seconds): the cpu_floor rows.
    # A restore hashes each part instead of recomputing its crc32c: one hash less one crc.
    out["hash_cpu_s"], out["crc_cpu_s"] = (round(cpu_over(state, f), 3) for f in (part_digest, crc32c))
    out["cpu_floor_save"] = round(1 + out["hash_cpu_s"] / out["save_cpu_crc32c_s"], 3)
    out["cpu_floor_restore"] = round(1 + (out["hash_cpu_s"] - out["crc_cpu_s"]) / out["restore_cpu_crc32c_s"], 3)
    return out


def cpu_over(state: dict, fn) -> float:
    """CPU seconds of ``fn`` over every byte of ``state`` in 2 MiB parts (a chunk), one thread."""
    t = time.thread_time()
    for v in state.values():
        mv = memoryview(v.numpy()).cast("B")
        for off in range(0, mv.nbytes, 2 << 20):
            fn(mv[off : off + (2 << 20)])
    return time.thread_time() - t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arrays", type=int, nargs="+", default=[300, 900])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--restore-at", type=int, nargs="+", default=[4096, 1024, 64])
    p.add_argument("--blake3", nargs="+", default=None, help="state sizes for the BLAKE3 rows alone (e.g. 1.5GiB)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per BLAKE3 row (default 5)")
    p.add_argument("--dir", default="/dev/shm", help="where the BLAKE3 rows' roots go (default /dev/shm)")
    a = p.parse_args(argv)
    if a.blake3:
        from benchmarks.common import parse_size

        for size in a.blake3:
            print(json.dumps({"size": size, **blake3_cost(parse_size(size), a.reps, a.dir)}), flush=True)
        return
    for arrays in a.arrays:
        print(json.dumps(commit_check(arrays, a.ranks)))
    for m in a.restore_at:
        print(json.dumps(restore_requests(a.arrays[0], a.ranks, m, m // 2)))


if __name__ == "__main__":
    main()
