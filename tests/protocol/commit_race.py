"""One process of the commit races of ``test_commit_race``: finishes its share of the ranks of
one save (or commits steps) on a filesystem root, released together with the other processes.

``python -m tests.protocol.commit_race ROOT MODE PROC NPROCS WORLD OUT``

- ``finish``: ranks PROC, PROC + NPROCS, ... of a WORLD-rank save of step 5, each through the
  real ``commit.finish_rank``, 4 at a time; writes the ranks it committed for to OUT. With
  ``hold`` as 7th argument the process finishes all but its last rank, writes OUT, and then waits
  to be killed (it never finishes its last rank).
- ``steps``: commits steps PROC + 1 + k * NPROCS for k < WORLD through ``commit.commit_step``.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptd import claims, commit
from ckptd import manifest as mf
from storage_backends import open_store


def main(root: str, mode: str, proc: int, nprocs: int, world: int, out: str, hold: str = "") -> None:
    store = open_store(root)
    go = Path(out).with_name("go")
    while not go.exists():  # released together
        time.sleep(0.001)
    if mode == "steps":
        mine = [proc + 1 + k * nprocs for k in range(world)]
        won = [s for s in mine if commit.commit_step(store, s, {"step": s})]
        Path(out).write_text(json.dumps(won))
        return
    if proc == 0:  # rank 0's part before anyone's done record: claim, manifest
        claims.begin(store, 5, "att", "job")
        m = mf.Manifest(step=5, world_size=world, tensors={}, state={}, attempt="att")
        store.put(f"{mf.step_dir(5)}/{mf.MANIFEST}", m.to_bytes())
        Path(out).with_name("claimed").write_text("")
    while not Path(out).with_name("claimed").exists():
        time.sleep(0.001)
    ranks = list(range(proc, world, nprocs))
    last = ranks.pop() if hold else None

    def finish(r: int) -> bool:
        return commit.finish_rank(store, 5, "att", r, world, {"rank": r, "bytes": r, "objects": 1})

    with ThreadPoolExecutor(4) as pool:
        won = [r for r, ok in zip(ranks, pool.map(finish, ranks), strict=True) if ok]
    Path(out).write_text(json.dumps(won))
    if last is not None:
        time.sleep(600)  # killed here, before its last rank finishes


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(int, sys.argv[3:6]), *sys.argv[6:])
