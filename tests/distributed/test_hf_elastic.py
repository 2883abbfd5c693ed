"""Hugging Face jobs that stop at 2 processes and resume at 3, for real (gloo on the CPU, each job
started by torchrun, the launcher both document; the first job's ranks SIGKILL themselves as a
preempted job dies): the model
records the sample index of every forward pass, and across both jobs every sample of the epoch
is trained on exactly once, counting the first job's steps up to the checkpoint the second one
restored (the steps after it are rolled back with the model). Then the second job moves on to
the next epoch in that epoch's order, and the optimizer's step count continues.

``ElasticTrainer`` is the Trainer path; ``accelerate`` is a plain ``accelerator.prepare`` loop
with the documented three-line swap (``docs/interop.md``). Without them, a stock Trainer with
``CkptdCallback`` restarts the epoch's data after the restore and repeats samples.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd import catalog
from storage_backends import open_store
from tests import load

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e .[hf])")
pytest.importorskip("accelerate", reason="the hf extra is not installed (pip install -e .[hf])")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hf_worker.py")
N, BATCH, SEED = 34, 2, 5  # as in hf_worker.py
KILL_AT, FINAL = 5, 9  # 2 ranks save at 2 and 4 and die at 5; 3 ranks finish epoch 0 at 7, then 2 steps of epoch 1


def committed(root: str) -> list[int]:
    with open_store(root) as store:
        return catalog.committed_steps(store)


def job(mode: str, world: int, out: Path, root: str, **args) -> None:
    """One job under ``torchrun --standalone --nproc-per-node=WORLD``; with ``kill_at`` its ranks
    die by SIGKILL, which torchrun reports as a failed child."""
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    argv += [str(WORKER), mode, json.dumps({"root": root, "out": str(out), **args})]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    log = out / "torchrun.log"
    with open(log, "w") as f:  # an idle machine takes ~20 s a job; a loaded one several times that
        rc = subprocess.run(
            argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=load.scaled(600)
        ).returncode
    text = log.read_text()
    if "kill_at" in args:
        assert rc != 0 and "Signal 9 (SIGKILL)" in text, text[-6000:]
    else:
        assert rc == 0, text[-6000:]


def records(out: Path, world: int) -> list[dict]:
    got = []
    for r in range(world):
        got += [json.loads(line) for line in (out / f"records.rank{r}.jsonl").read_text().splitlines()]
    return got


def epoch_order(epoch: int) -> list[int]:
    from trainer_hooks import ElasticSampler

    sampler = ElasticSampler(N, seed=SEED, rank=0, num_replicas=1)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("mode", ["trainer", "accelerate"])
def test_two_processes_then_three_train_each_sample_once(tmp_path: Path, mode: str) -> None:
    root = str(tmp_path / "job")
    # the Trainer's loader with a worker process, which prefetches batches ahead of training
    loader = {"num_workers": 1} if mode == "trainer" else {}
    job(mode, 2, tmp_path / "first", root, max_steps=100, kill_at=KILL_AT, **loader)
    assert committed(root) == [2, 4]
    first = [r for r in records(tmp_path / "first", 2) if r["step"] <= 4]
    assert sorted(r["step"] for r in records(tmp_path / "first", 2)) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]

    job(mode, 3, tmp_path / "second", root, max_steps=FINAL, **loader)
    results = [json.loads((tmp_path / "second" / f"result{r}.json").read_text()) for r in range(3)]
    for res in results:
        assert res["restored"] == 4 and res["global_step"] == FINAL
        assert res["optimizer_steps"] == [FINAL]  # AdamW's count went on from the restored 4
        if mode == "trainer":
            assert res["sched_last_epoch"] == FINAL
    second = records(tmp_path / "second", 3)
    assert sorted({r["step"] for r in second}) == list(range(KILL_AT, FINAL + 1))

    epoch0 = [i for r in first + second if r["epoch"] == 0 for i in r["idx"]]
    repeated = [i for i, n in collections.Counter(epoch0).items() if n > 1]
    assert not repeated, f"trained on twice in epoch 0: {sorted(repeated)}"
    assert sorted(epoch0) == list(range(N))
    # 2 ranks x 4 steps x 2, then 3 ranks x 3 steps x 2: the rest of the epoch, dealt to 3
    assert {r["step"] for r in second if r["epoch"] == 0} == {5, 6, 7}
    epoch1 = [i for r in second if r["epoch"] == 1 for i in r["idx"]]
    assert sorted(epoch1) == sorted(epoch_order(1)[: 2 * 3 * BATCH])
    assert committed(root)[-1] == FINAL
