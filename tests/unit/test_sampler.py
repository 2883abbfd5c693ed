"""ElasticSampler and StatefulLoader: exactly-once sampling across changes of world size.

Ranks are simulated in one process: each simulated rank has its own sampler with an explicit
rank and world size, and the ranks are stepped in lockstep, one batch each per step, as
synchronous data-parallel training consumes them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from trainer_hooks.sampler import ElasticSampler, StatefulLoader

SIZES = (37, 50, 101)
STOPS = (0, 1, 2, 5, 13, None)  # lockstep steps before the checkpoint; None: to the end


def make_ranks(world, n, *, shuffle=True, drop_last=False, seed=0, state=None):
    samplers = [
        ElasticSampler(n, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=r, num_replicas=world)
        for r in range(world)
    ]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    return samplers


def run_lockstep(samplers, steps, batch_size):
    """Steps every rank `steps` times (None: until every rank is exhausted), batching as
    DataLoader(num_workers=0) does; returns the indices delivered, all ranks together."""
    iters = [iter(BatchSampler(s, batch_size, drop_last=False)) for s in samplers]
    got = []
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            break
        for batch in batches:
            got += batch or []
        step += 1
    return got


def common_state(samplers):
    states = [s.state_dict() for s in samplers]
    assert all(state == states[0] for state in states), states
    return states[0]


def order_of(n, shuffle, seed=0, epoch=0):
    sampler = ElasticSampler(n, shuffle=shuffle, seed=seed, rank=0, num_replicas=1)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_exactly_once(got, order, drop_last, worlds, batch_size=1):
    """With drop_last only less than one round of the tail may be missing; a DataLoader with
    drop_last=True also drops each rank's last partial batch, hence batch_size."""
    assert len(got) == len(set(got)), "an index was yielded twice"
    # the job always consumes a prefix of the epoch's order ...
    assert set(got) == set(order[: len(got)])
    if drop_last:
        # ... and drop_last only drops the tail
        assert len(order) - len(got) < max(worlds) * batch_size
    else:
        assert len(got) == len(order)


def resume_chain(n, shuffle, drop_last, worlds, stops, batch_size):
    """Runs the epoch at worlds[0] for stops[0] steps, checkpoints, resumes at worlds[1], ...;
    the last world runs to the end. Returns all indices delivered."""
    state, got = None, []
    for i, world in enumerate(worlds):
        samplers = make_ranks(world, n, shuffle=shuffle, drop_last=drop_last, state=state)
        steps = stops[i] if i < len(stops) else None
        delivered = run_lockstep(samplers, steps, batch_size)
        got += delivered
        state = common_state(samplers)
        assert json.loads(json.dumps(state)) == state
        if not drop_last or state["position"] != n:
            assert state["position"] == len(got)
    assert state["position"] == n
    return got


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_exactly_once_n_to_m(n_ranks, m, shuffle, drop_last):
    for size in SIZES:
        order = order_of(size, shuffle)
        for batch_size in (1, 3):
            for stop in STOPS:
                got = resume_chain(size, shuffle, drop_last, [n_ranks, m], [stop], batch_size)
                check_exactly_once(got, order, drop_last, [n_ranks, m])


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("worlds", [(1, 3, 2), (4, 1, 3), (2, 4, 4), (3, 2, 1), (4, 3, 2)])
def test_exactly_once_chained(worlds, drop_last):
    for size in SIZES:
        order = order_of(size, True)
        for stops in ((1, 1), (2, 5), (0, 3), (7, 0), (4, None)):
            got = resume_chain(size, True, drop_last, list(worlds), list(stops), 2)
            check_exactly_once(got, order, drop_last, worlds)


def test_resumed_ranks_deal_the_rest_round_robin():
    order = order_of(50, True)
    first = make_ranks(2, 50)
    run_lockstep(first, 4, 3)  # 4 steps x 3 per batch x 2 ranks
    state = common_state(first)
    assert state["position"] == 24
    second = make_ranks(3, 50, state=state)
    for rank, sampler in enumerate(second):
        assert list(sampler) == order[24 + rank :: 3]


def test_state_is_the_same_on_every_rank_through_an_uneven_tail():
    # 37 over 4 ranks: shares 10, 9, 9, 9; with batches of 3 rank 0 takes a 4th step alone
    samplers = make_ranks(4, 37)
    assert [len(s) for s in samplers] == [10, 9, 9, 9]
    for steps in range(1, 6):
        fresh = make_ranks(4, 37)
        got = run_lockstep(fresh, steps, 3)
        state = common_state(fresh)
        assert state["position"] == len(got) == min(steps * 3 * 4, 37)


def test_global_order_does_not_depend_on_world_size():
    order = order_of(101, True, seed=7)
    for world in (2, 3, 4):
        dealt = [list(s) for s in make_ranks(world, 101, seed=7)]
        merged = [dealt[i % world][i // world] for i in range(101)]
        assert merged == order


def test_determinism_and_epochs():
    assert order_of(50, True, seed=3) == order_of(50, True, seed=3)
    assert order_of(50, True, seed=3) != order_of(50, True, seed=4)
    assert order_of(50, True, seed=3, epoch=0) != order_of(50, True, seed=3, epoch=1)
    assert order_of(50, False, seed=3, epoch=5) == list(range(50))
    assert sorted(order_of(50, True)) == list(range(50))
    # the same permutation DistributedSampler draws
    generator = torch.Generator()
    generator.manual_seed(3 + 2)
    assert order_of(50, True, seed=3, epoch=2) == torch.randperm(50, generator=generator).tolist()


def test_set_epoch_resets_position_only_for_a_new_epoch():
    sampler = ElasticSampler(20, rank=0, num_replicas=2)
    it = iter(sampler)
    for _ in range(3):
        next(it)
    assert sampler.position == 6
    sampler.set_epoch(0)
    assert sampler.position == 6
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.position) == (1, 0)
    assert list(sampler) == order_of(20, True, epoch=1)[0::2]


def test_a_pass_left_early_continues_where_it_stopped():
    sampler = ElasticSampler(10, shuffle=False, rank=0, num_replicas=1)
    it = iter(sampler)
    assert [next(it), next(it)] == [0, 1]
    assert sampler.position == 2
    assert list(sampler) == list(range(2, 10))


def test_a_finished_pass_leaves_the_epoch_done_and_the_next_pass_starts_over():
    sampler = ElasticSampler(10, rank=1, num_replicas=2)
    first = list(sampler)
    assert sampler.position == 10
    assert sampler.state_dict()["position"] == 10
    assert len(sampler) == 5
    assert list(sampler) == first  # same epoch again, like DistributedSampler without set_epoch


def test_a_restored_finished_epoch_yields_nothing_until_the_next_epoch():
    done = ElasticSampler(10, rank=0, num_replicas=1)
    list(done)
    restored = ElasticSampler(10, rank=0, num_replicas=3)
    restored.load_state_dict(done.state_dict())
    restored.set_epoch(0)
    assert len(restored) == 0
    assert list(restored) == []
    restored.set_epoch(1)
    assert len(restored) == 4
    assert list(restored) == order_of(10, True, epoch=1)[0::3]


def test_len():
    assert [len(s) for s in make_ranks(4, 37)] == [10, 9, 9, 9]
    assert [len(s) for s in make_ranks(4, 37, drop_last=True)] == [9, 9, 9, 9]
    assert [len(s) for s in make_ranks(4, 2)] == [1, 1, 0, 0]
    assert [len(s) for s in make_ranks(4, 2, drop_last=True)] == [0, 0, 0, 0]
    assert [len(s) for s in make_ranks(3, 0)] == [0, 0, 0]
    state = {**make_ranks(1, 37)[0].state_dict(), "position": 5}
    assert [len(s) for s in make_ranks(3, 37, state=state)] == [11, 11, 10]
    assert [len(s) for s in make_ranks(3, 37, drop_last=True, state=state)] == [10, 10, 10]
    for world in (1, 2, 3, 4):
        for sampler in make_ranks(world, 37, state=state):
            assert len(sampler) == len(list(sampler))


def test_state_dict_is_json_of_ints_and_bools():
    sampler = ElasticSampler(37, shuffle=False, seed=5, drop_last=True, rank=2, num_replicas=3)
    state = sampler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "version": 1,
        "epoch": 0,
        "position": 0,
        "seed": 5,
        "shuffle": False,
        "drop_last": True,
        "dataset_len": 37,
    }


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dataset_len", 38, "dataset_len=38, this sampler has dataset_len=37"),
        ("seed", 1, "seed=1, this sampler has seed=0"),
        ("shuffle", False, "shuffle=False, this sampler has shuffle=True"),
        ("shuffle", 1, "shuffle=1, this sampler has shuffle=True"),
        ("position", 38, "past dataset_len=37"),
        ("position", -1, "must be >= 0"),
        ("version", 2, "version 2"),
    ],
)
def test_load_refuses_a_foreign_state(key, value, message):
    sampler = ElasticSampler(37, rank=0, num_replicas=1)
    before = sampler.state_dict()
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict({**before, key: value})
    assert sampler.state_dict() == before


def test_load_refuses_missing_keys_and_accepts_another_drop_last():
    sampler = ElasticSampler(37, rank=0, num_replicas=2)
    state = sampler.state_dict()
    del state["epoch"]
    with pytest.raises(ValueError, match="lacks epoch"):
        sampler.load_state_dict(state)
    other = ElasticSampler(37, drop_last=True, rank=0, num_replicas=1)
    sampler.load_state_dict({**other.state_dict(), "epoch": 3, "position": 11})
    assert (sampler.epoch, sampler.position, sampler.state_dict()["drop_last"]) == (3, 11, False)


def test_rank_and_world_size():
    sampler = ElasticSampler(10)  # torch.distributed not initialised
    assert (sampler.rank, sampler.num_replicas) == (0, 1)
    with pytest.raises(ValueError, match="rank must be < num_replicas=2"):
        ElasticSampler(10, rank=2, num_replicas=2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        ElasticSampler(10, rank=0, num_replicas=0)
    with pytest.raises(TypeError, match="dataset_len must be an int"):
        ElasticSampler(True)


# -- DataLoader --------------------------------------------------------------------------------


def make_loaders(world, n, batch_size, *, state=None, num_workers=2, drop_last=False):
    dataset = TensorDataset(torch.arange(n))
    loaders = []
    for sampler in make_ranks(world, n, drop_last=drop_last, state=state):
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            prefetch_factor=2 if num_workers else None,
            drop_last=drop_last,
        )
        loaders.append(StatefulLoader(loader))
    return loaders


def run_loaders(loaders, steps):
    iters = [iter(loader) for loader in loaders]
    got = []
    step = 0
    try:
        while steps is None or step < steps:
            batches = [next(it, None) for it in iters]
            if all(b is None for b in batches):
                break
            for batch in batches:
                if batch is not None:
                    (indices,) = batch
                    got += indices.tolist()
            step += 1
    finally:
        for it in iters:
            it.close()  # shuts the workers down now
    return got


def test_dataloader_workers_prefetch_ahead_of_training():
    # Why StatefulLoader exists: the workers' prefetch pulls indices training has not seen.
    sampler = ElasticSampler(60, rank=0, num_replicas=1)
    loader = DataLoader(TensorDataset(torch.arange(60)), batch_size=4, sampler=sampler, num_workers=2)
    it = iter(loader)
    next(it)
    assert sampler.position > 4
    del it


@pytest.mark.parametrize("drop_last", [False, True])
def test_stateful_loader_with_workers_resumes_exactly_once_at_another_world_size(drop_last):
    n, order = 101, order_of(101, True)
    first = make_loaders(2, n, 4, drop_last=drop_last)
    got = run_loaders(first, 3)
    assert len(got) == 3 * 4 * 2
    assert set(got) == set(order[:24])
    state = common_state([loader.sampler for loader in first])
    assert state["position"] == 24

    second = make_loaders(3, n, 4, state=state, drop_last=drop_last)
    got += run_loaders(second, None)
    final = common_state([loader.sampler for loader in second])
    assert final["position"] == n
    check_exactly_once(got, order, drop_last, [3], batch_size=4)


def test_stateful_loader_without_workers_and_through_a_batch_sampler():
    dataset = TensorDataset(torch.arange(37))
    # batch_size=None: no auto-batching, one sample per step
    per_sample = [StatefulLoader(DataLoader(dataset, batch_size=None, sampler=s)) for s in make_ranks(2, 37)]
    iters = [iter(loader) for loader in per_sample]
    got = []
    for _ in range(5):
        for it in iters:
            (index,) = next(it)
            got.append(int(index))
    state = common_state([loader.sampler for loader in per_sample])
    assert state["position"] == 10
    through = [
        StatefulLoader(DataLoader(dataset, batch_sampler=BatchSampler(s, 5, drop_last=False)))
        for s in make_ranks(3, 37, state=state)
    ]
    got += run_loaders(through, None)
    check_exactly_once(got, order_of(37, True), False, [3])


def test_stateful_loader_refuses_other_samplers():
    dataset = TensorDataset(torch.arange(10))
    with pytest.raises(TypeError, match="sampler=ElasticSampler"):
        StatefulLoader(DataLoader(dataset, batch_size=2))
    with pytest.raises(TypeError, match="sampler=ElasticSampler"):
        StatefulLoader(DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 2, False)))
