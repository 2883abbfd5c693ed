"""Pure write planning: every shard has exactly one writer, writers hold (or receive) all of
its rows, and per-key planning is O(1) per rank."""

import math

import pytest

from ckptd.codec import ArrayLayout
from ckptd.layout import Box, plan_grid, plan_writes


def chunks(n, k):
    s = -(-n // k)
    return [(min(i * s, n), min(i * s + s, n)) for i in range(k)]


def fsdp(shape, ws):
    return [Box((a, *[0] * (len(shape) - 1)), (b, *shape[1:])) for a, b in chunks(shape[0], ws)]


def fsdp_tp(shape, tp, dp):  # TP splits dim 0, then FSDP splits each TP block again
    out = []
    for a, b in chunks(shape[0], tp):
        for c, d in chunks(b - a, dp):
            out.append(Box((a + c, *[0] * (len(shape) - 1)), (a + d, *shape[1:])))
    return out


def hsdp(shape, replicas, shards):  # rank = replica * shards + shard
    return [b for _ in range(replicas) for b in fsdp(shape, shards)]


LAYOUTS = [
    ("fsdp-even", (16, 4), fsdp((16, 4), 4)),
    ("fsdp-uneven", (37, 4), fsdp((37, 4), 4)),
    ("fsdp-empty-block", (3,), fsdp((3,), 4)),
    ("replicated-small", (5, 5), [Box.full((5, 5))] * 3),
    ("replicated-split", (4096, 1024), [Box.full((4096, 1024))] * 3),
    ("hsdp", (10, 2), hsdp((10, 2), 2, 3)),
    ("2d-uneven", (50257, 8), fsdp_tp((50257, 8), 2, 2)),
    ("scalar", (), [Box.full(())] * 2),
    ("empty", (0, 3), [Box.full((0, 3))] * 2),
]


@pytest.mark.parametrize("name,shape,blocks", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("key", ["model/a", "optim/state/b/exp_avg"])
def test_each_shard_has_one_writer_holding_its_rows(name, shape, blocks, key):
    grid = plan_grid(shape, 4, "float32", blocks)
    plan = plan_writes(key, shape, 4, "float32", blocks)
    mine = {r: grid.shards_of(key, r) for r in range(len(blocks))}
    written = sorted(c for cs in mine.values() for c in cs)
    assert written == sorted(grid.coords) == sorted(plan.writers)
    for r, coords in mine.items():
        for c in coords:
            assert plan.writers[c] == r
            cell = Box(*grid.layout.shard_box(c))
            own = blocks[r].intersect(cell)
            received = sum(t.box.volume for t in plan.transfers if t.dst == r and cell.intersect(t.box))
            assert (own.volume if own else 0) + received == cell.volume
    for t in plan.transfers:
        assert blocks[t.src].intersect(t.box) == t.box  # the sender holds what it sends
    if math.prod(shape):  # every shard of the grid is planned
        assert len(grid.coords) == sum(1 for _ in grid.layout.shard_coords())


def test_uneven_2d_is_the_even_grid_with_boundary_transfers():
    plan = plan_writes("emb", (50257, 8), 4, "float32", fsdp_tp((50257, 8), 2, 2))
    assert plan.layout.shard_shape == (12565, 8)
    assert [(t.src, t.dst, t.box.start[0], t.box.stop[0]) for t in plan.transfers] == [
        (2, 1, 25129, 25130),
        (3, 2, 37693, 37695),
    ]


def test_replicated_large_tensors_spread_over_all_replicas():
    grid = plan_grid((4096, 1024), 4, "float32", [Box.full((4096, 1024))] * 4)
    assert sorted(len(grid.shards_of("w", r)) for r in range(4)) == [1, 1, 1, 1]
    small = plan_grid((4, 4), 4, "float32", [Box.full((4, 4))] * 4)
    writers = {small.writer(f"k{i}", 0) for i in range(40)}
    assert len(writers) > 1  # different keys land on different ranks


def test_planning_cost_is_per_signature_not_per_tensor():
    ranks = 4096
    grid = plan_grid((ranks * 10, 64), 4, "float32", fsdp((ranks * 10, 64), ranks))
    assert len(grid._mine[7]) == 1  # rank 7 is a candidate for one shard only
    assert [grid.shards_of(f"layers.{i}.w", 7) for i in range(3)] == [[(7, 0)]] * 3


@pytest.mark.parametrize("name,shape,blocks", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_each_rank_derives_its_own_transfers_with_the_indices_both_ends_agree_on(name, shape, blocks):
    grid = plan_grid(shape, 4, "float32", blocks)
    for key in [f"optim/state/l{i}.bias/exp_avg" for i in range(12)]:
        every = list(enumerate(grid.transfers(key)))
        for r in range(len(blocks)):
            assert grid.transfers_of(key, r) == [(j, t) for j, t in every if r in (t.src, t.dst)]


def test_small_sharded_tensors_are_one_shard_gathered_by_one_rank():
    """An FSDP-sharded bias is one object written by one rank (which receives the other blocks),
    not one tiny object per rank; the writer moves from key to key."""
    blocks = fsdp((1000,), 4)
    grid = plan_grid((1000,), 4, "float32", blocks)
    assert grid.gather and grid.layout.shard_shape == (1000,) and grid.coords == ((0,),)
    writers = set()
    for i in range(40):
        plan = plan_writes(f"model/l{i}.bias", (1000,), 4, "float32", blocks)
        (w,) = plan.writers.values()
        writers.add(w)
        assert sorted(t.src for t in plan.transfers) == sorted(set(range(4)) - {w})
        assert all(t.dst == w and t.box == blocks[t.src] for t in plan.transfers)
    assert len(writers) > 1
    hsdp_grid = plan_grid((10, 2), 4, "float32", hsdp((10, 2), 2, 3))
    assert len(hsdp_grid.transfers("k")) == 2  # 3 distinct blocks, the writer holds one
    big = plan_grid((4096, 64), 4, "float32", fsdp((4096, 64), 4))  # 1 MiB: sharded as saved
    assert not big.gather and len(big.coords) == 4


def test_array_layout_json_round_trips_and_is_the_manifest_row():
    """``ArrayLayout.to_json`` is the one spelling of a layout in JSON: the manifest's tensor rows
    (whose key order is part of the stored bytes) and the daemon hand-off both use it."""
    from ckptd.manifest import TensorEntry

    lay = ArrayLayout((10, 6), "bfloat16", (4, 6), (2, 6))
    assert lay.to_json() == {"shape": [10, 6], "dtype": "bfloat16", "shard_shape": [4, 6], "chunk_shape": [2, 6]}
    assert ArrayLayout.from_json(lay.to_json()) == lay
    row = TensorEntry("model/w", lay, "Shard(0)").to_json()
    assert list(row) == ["key", "path", "shape", "dtype", "shard_shape", "chunk_shape", "nbytes", "placements"]
    assert TensorEntry.from_json(row).layout == lay


def test_empty_arrays_have_one_layout_everywhere():
    """An array with no elements is metadata only, whoever plans it: the trainer's grid, the
    streaming writer's default and the reshard target all give ``ArrayLayout.empty``."""
    from ckptd.reshard import aligned_layout
    from ckptd.stream import default_layout

    for shape in [(0,), (0, 5), (3, 0, 2)]:
        want = ArrayLayout.empty(shape, "float32")
        assert want.shard_shape == want.chunk_shape == tuple(max(1, n) for n in shape)
        assert plan_grid(shape, 4, "float32", [Box.full(shape)] * 2).layout == want
        assert default_layout(shape, "float32", 4) == want
        assert aligned_layout(shape, "float32", 4, [Box.full(shape)]) == want
