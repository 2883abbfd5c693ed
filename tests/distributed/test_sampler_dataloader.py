"""ElasticSampler in real gloo jobs: rank and world size come from torch.distributed, the state
saved at 2 ranks resumes at 3, and every index of the epoch is trained on once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from trainer_hooks.sampler import ElasticSampler, StatefulLoader

N = 101
BATCH = 4


def _worker(rank: int, world: int, folder: str, phase: int, steps: int | None) -> None:
    out = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{out / f'store{phase}'}", rank=rank, world_size=world)
    try:
        sampler = ElasticSampler(N, seed=3)  # rank and world size from the process group
        assert (sampler.rank, sampler.num_replicas) == (rank, world)
        if phase > 0:
            sampler.load_state_dict(json.loads((out / f"state{phase - 1}.json").read_text()))
        loader = StatefulLoader(
            DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, sampler=sampler, num_workers=1)
        )
        got: list[int] = []
        for step, (indices,) in enumerate(loader):
            got += indices.tolist()
            dist.all_reduce(torch.ones(1))  # the lockstep a data-parallel step imposes
            if steps is not None and step + 1 == steps:
                break
        states: list[dict | None] = [None] * world
        dist.all_gather_object(states, sampler.state_dict())
        if rank == 0:
            assert all(state == states[0] for state in states), states
            (out / f"state{phase}.json").write_text(json.dumps(states[0]))
        (out / f"got{phase}_{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_at_another_world_size_trains_each_index_once(tmp_path: Path) -> None:
    # 2 ranks train 5 steps and save; 3 ranks resume, train 5 steps and save; one rank
    # (here, in-process) resumes and finishes the epoch.
    mp.start_processes(_worker, args=(2, str(tmp_path), 0, 5), nprocs=2, start_method="spawn")
    state = json.loads((tmp_path / "state0.json").read_text())
    assert state["position"] == 5 * BATCH * 2
    mp.start_processes(_worker, args=(3, str(tmp_path), 1, 5), nprocs=3, start_method="spawn")
    state = json.loads((tmp_path / "state1.json").read_text())
    assert state["position"] == 40 + 5 * BATCH * 3

    got = []
    for path in sorted(tmp_path.glob("got*.json")):
        got += json.loads(path.read_text())
    rest = ElasticSampler(N, seed=3, rank=0, num_replicas=1)
    rest.load_state_dict(state)
    got += list(rest)
    assert sorted(got) == list(range(N))
