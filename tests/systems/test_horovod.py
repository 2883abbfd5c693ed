"""Horovod for real: ``horovodrun -np 2 --gloo``, then ``-np 3``, with ``trainer_hooks.horovod``.

Horovod 0.28.1 (the last release) does not build against torch >= 2.1 as published: its PyTorch
extension is compiled as C++14. ``deploy/build_horovod.sh`` builds it from the sdist with C++17
into ``~/.cache/ckptd/horovod-<sdist sha256>``; ``.ci/run`` runs it on every run (a cached wheel is
installed at once). Without horovod this file is skipped (reason given), and CI says so at its end.

The job (``tests/systems/hvd_train.py``): ``hvd.DistributedOptimizer`` around AdamW, the gradient
all-reduce through Horovod's gloo, an ``ElasticSampler``, ``trainer_hooks.horovod.resume``.
At 2 ranks it trains 4 steps and saves step 3; at 3 ranks it resumes and runs to the end of the
epoch. Checked: step 3 is one committed 2-rank checkpoint (without ``init_process_group`` each
process is its own job and the second is refused as another writer); every rank at 3 holds
exactly the model and AdamW state rank 0 held when it saved at 2, bit for bit (so no broadcast is
needed after a restore); on the fresh start the ranks, seeded differently, were made replicas by
``resume``'s broadcast; every sample of the epoch trained on exactly once; the replicas agree at
the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests import load

REPO = Path(__file__).resolve().parents[2]
SAMPLES, GLOBAL_BATCH, STOP_AT = 96, 12, 3  # 8 steps; 12 splits over 2 and 3 ranks

hvd = pytest.importorskip(
    "horovod.torch", reason="horovod not installed: deploy/build_horovod.sh --install (builds 0.28.1 for this torch)"
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # above the sum of the runs' own bounds (2 x 300 + 120 s), times load.SCALE
    pytest.mark.skipif(shutil.which("horovodrun") is None, reason="horovodrun not on PATH"),
]


def _horovodrun(n: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = ["horovodrun", "-np", str(n), "--gloo", sys.executable, "tests/systems/hvd_train.py", *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return load.run(cmd, 300, cwd=REPO, env=full_env)


def _ls(root: Path) -> list[dict]:
    p = load.run(
        [sys.executable, "-m", "ckptd.cli.main", "ls", str(root), "--json"],
        120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_horovodrun_saves_at_2_resumes_at_3_bitwise_every_sample_once(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    common = ["--root", str(root), "--out", str(out), "--samples", str(SAMPLES), "--global-batch", str(GLOBAL_BATCH)]
    first = _horovodrun(2, *common, "--stop-at", str(STOP_AT))
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    steps = _ls(root)
    assert [(s["step"], s["committed"], s["world_size"]) for s in steps] == [(STOP_AT, True, 2)], steps

    # The fresh start: differently seeded ranks made replicas by resume's broadcast from rank 0.
    assert _equal(torch.load(out / "resumed-w2-r0.pt"), torch.load(out / "resumed-w2-r1.pt"))
    saved = torch.load(out / "saved-w2-r0.pt")
    assert _equal(saved, torch.load(out / "saved-w2-r1.pt"))
    assert any(k.endswith(".exp_avg") for k in saved), saved.keys()  # AdamW state, not just weights

    second = _horovodrun(3, *common)
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    for r in range(3):  # every rank restored what rank 0 held at the save, bit for bit
        assert _equal(torch.load(out / f"resumed-w3-r{r}.pt"), saved), r
    finals = [torch.load(out / f"final-w3-r{r}.pt") for r in range(3)]
    assert _equal(finals[0], finals[1]) and _equal(finals[0], finals[2])
    assert not _equal(finals[0], saved)  # it trained on after the restore

    records = [json.loads(line) for f in sorted(out.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    world_of: dict[int, set[int]] = {}
    for r in records:
        world_of.setdefault(r["step"], set()).add(r["world"])
    assert world_of == {s: {2} if s <= STOP_AT else {3} for s in range(SAMPLES // GLOBAL_BATCH)}, world_of
    seen = Counter(i for r in records for i in r["indices"])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}


def test_the_optimizer_horovod_replaced_is_refused_beside_its_wrapper(tmp_path):
    """``hvd.DistributedOptimizer(opt)`` trains a new object; ``opt`` in the state beside it would
    be restored and never used again: refused with a line that says which to keep."""
    code = f"""
import horovod.torch as hvd, torch
from trainer_hooks import Checkpointer, CheckpointError
from trainer_hooks.horovod import init_process_group, is_distributed_optimizer, resume
hvd.init()
init_process_group()
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
wrapped = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
assert is_distributed_optimizer(wrapped) and not is_distributed_optimizer(opt)
with Checkpointer({str(tmp_path / "root")!r}) as ck:
    try:
        resume(ck, {{"model": model, "opt": opt, "wrapped": wrapped}})
    except CheckpointError as e:
        print("REFUSED:", e)
    print("STEP", resume(ck, {{"model": model, "wrapped": wrapped}}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = load.run([sys.executable, "-c", code], 120, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "REFUSED: state['opt'] is the optimizer given to hvd.DistributedOptimizer" in p.stdout, p.stdout
    assert "STEP 0" in p.stdout, p.stdout
