"""Ray Train (``trainer_hooks.ray``) for real: a local Ray cluster, ``TorchTrainer`` on CPU with
gloo, 4 workers that stop after step 7, then a new ``fit`` at 3 workers that resumes from ckptd
and runs to the end of the epoch. Every sample once, the final state bitwise equal to an
uninterrupted single-process run (``exact_train``), and each committed step reported to Ray
(``Result.checkpoint`` points at the ckptd root and step).

Two variants: ``fixed`` asks for 4 workers, then 3; ``elastic`` gives both fits the same
``ScalingConfig(num_workers=(2, 4))`` on a cluster of 4 CPUs, then of 3, and Ray sizes the group.

Ray runs in a subprocess (``tests/systems/ray_job.py``): its own warnings and threads stay out of
pytest. Each variant takes about 1 minute on this 2-core machine (Ray's start-up dominates);
``ray[train]`` is in the dev extra, and without it the test is skipped.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests import load

REPO = Path(__file__).resolve().parents[2]
SAMPLES, GLOBAL_BATCH, STOP = 240, 12, 7

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),  # above the sum of the runs' own bounds (300 + 1,100 s), times load.SCALE
]


@pytest.mark.parametrize("elastic", [None, "2-4"], ids=["fixed", "elastic"])
def test_torchtrainer_4_workers_stop_then_3_workers_exactly_once_bitwise(tmp_path, elastic):
    """``fixed``: the script asks for 4 workers, then 3. ``elastic``: both fits use the same
    ``ScalingConfig(num_workers=(2, 4))`` and Ray sizes the group to the cluster it finds, 4 CPUs
    then 3 (a node lost between the runs)."""
    pytest.importorskip("ray.train.torch")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    ref = load.run(
        [sys.executable, "tests/systems/exact_train.py", "--root", str(tmp_path / "ref"), "--samples", str(SAMPLES)]
        + ["--global-batch", str(GLOBAL_BATCH), "--final", str(tmp_path / "ref.pt")],
        300,
        cwd=REPO,
        env=env,
    )
    assert ref.returncode == 0, ref.stderr
    root, logs = tmp_path / "root", tmp_path / "logs"
    p = load.run(
        [sys.executable, "-m", "tests.systems.ray_job", "--root", str(root), "--run", f"4:{STOP}", "--run", "3"]
        + ["--log-dir", str(logs), "--storage", str(tmp_path / "ray"), "--final", str(tmp_path / "final.pt")]
        + ["--samples", str(SAMPLES), "--global-batch", str(GLOBAL_BATCH), "--every", "5"]
        + (["--elastic", elastic] if elastic else []),
        1100,
        cwd=REPO,
        env=env,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    results = [json.loads(line[len("RESULT ") :]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    last = SAMPLES // GLOBAL_BATCH - 1
    # Ray's bookkeeping knows ckptd's committed steps: 4 and STOP in the first run, then every
    # fifth step and the last one in the second
    assert results[0]["checkpoint"] == [str(root), STOP] and results[0]["metrics"]["ckptd_step"] == STOP
    assert sorted(s for _, s in results[0]["best"]) == [4, STOP]
    assert results[1]["checkpoint"] == [str(root), last]

    steps = []
    for f in logs.glob("rank*.jsonl"):
        steps += [json.loads(line) for line in f.read_text().splitlines() if '"step"' in line]
    steps = [r for r in steps if r["event"] == "step"]
    worlds = {}
    for r in steps:
        worlds.setdefault(r["step"], set()).add((r["world"], r["rank"]))
    assert sorted(worlds) == list(range(last + 1))
    for s, ranks in worlds.items():
        world = 4 if s <= STOP else 3
        assert ranks == {(world, r) for r in range(world)}, (s, ranks)
    seen = Counter(i for r in steps for i in r["indices"])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}
    final, reference = torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "ref.pt")
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), k
