"""The pure planning of ``ckptd reshard``: target layouts, what cannot work, per-rank reads,
rechunked layouts and the data position. No storage, no torch.distributed process group; torch
is used only as the reference for its chunking rules and the ElasticSampler."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from ckptd.codec import CRC_BYTES, ArrayLayout
from ckptd.layout import Box, chunk_box, plan_reads, read_cost
from ckptd.manifest import TensorEntry
from ckptd.reshard import (
    LayoutError,
    LayoutSyntaxError,
    TargetLayout,
    aligned_layout,
    parse_layout,
    plan_reads_for,
    rank_box,
    rank_boxes,
    saved_sharded,
    sharded_keys,
    strided_mismatch,
    validate,
    whole_chunks,
)
from ckptd.sampler_math import find_samplers, remap_data_position, sampler_resume
from trainer_hooks.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(120)


def entry(key, shape, shard, chunk=None, placements="S(0)", dtype="float32"):
    return TensorEntry(key, ArrayLayout(tuple(shape), dtype, tuple(shard), tuple(chunk or shard)), placements)


# ------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    "text,ws,want",
    [
        ("fsdp", 3, TargetLayout("fsdp", 3, 1, 3)),
        (" FSDP ", 1, TargetLayout("fsdp", 1, 1, 1)),
        ("ddp", 4, TargetLayout("replicated", 4, 1, 1)),
        ("replicated", 2, TargetLayout("replicated", 2, 1, 1)),
        ("tp=2", 4, TargetLayout("tp", 4, 2, 2)),
        ("tp=2,dp=3", 6, TargetLayout("tp", 6, 2, 3)),
        ("dp=3, tp=2", 6, TargetLayout("tp", 6, 2, 3)),
        ("dp=4", 4, TargetLayout("fsdp", 4, 1, 4)),
        ("tp=1", 3, TargetLayout("fsdp", 3, 1, 3)),
        ("tp=4", 4, TargetLayout("tp", 4, 4, 1)),
    ],
)
def test_parse_layout(text, ws, want):
    got = parse_layout(text, ws)
    assert got == want
    assert parse_layout(got.spec, ws) == got  # the canonical text parses back


@pytest.mark.parametrize(
    "text,ws,reason",
    [
        ("fsdp", 0, "at least 1 rank"),  # --to 0
        ("ddp", -2, "at least 1 rank"),
        ("tp=3", 4, "tp=3 does not divide world size 4"),
        ("tp=2,dp=3", 4, "2 x 3 = 6 ranks, but the job has 4"),
        ("tp=2,dp=2", 2, "2 x 2 = 4 ranks, but the job has 2"),
        ("dp=3", 4, "dp=3 does not divide world size 4"),
        ("tp=0", 4, "tp=0 is not a mesh size"),
    ],
)
def test_layouts_that_cannot_work(text, ws, reason):
    with pytest.raises(LayoutError, match=reason):
        parse_layout(text, ws)


@pytest.mark.parametrize("text", ["foo", "tp", "tp=", "tp=x", "tp=2,tp=2", "tp=2;dp=2", "fsdp,tp=2", ""])
def test_layout_syntax_errors(text):
    with pytest.raises(LayoutSyntaxError, match="invalid layout"):
        parse_layout(text, 4)


def test_slug_and_describe():
    assert parse_layout("fsdp", 3).slug == "to_3_fsdp"
    assert parse_layout("tp=2", 4).slug == "to_4_tp2_dp2"
    assert parse_layout("ddp", 2).slug == "to_2_replicated"
    assert "tp=2 x dp=2" in parse_layout("tp=2", 4).describe()


# ---------------------------------------------------------------------------- rank blocks


@pytest.mark.parametrize("n,m", [(37, 3), (37, 4), (5, 4), (3, 5), (1, 2), (0, 3), (12, 4)])
def test_fsdp_blocks_are_torch_chunk(n, m):
    target = parse_layout("fsdp", m)
    pieces = list(torch.arange(n).chunk(m)) if n else []
    for r in range(m):
        box = rank_box((n, 7), True, target, r)
        want = pieces[r].tolist() if r < len(pieces) else []
        assert list(range(box.start[0], box.stop[0])) == want
        assert (box.start[1], box.stop[1]) == (0, 7)


def test_replicated_and_scalar_tensors_are_read_whole():
    for target in (parse_layout("ddp", 3), parse_layout("fsdp", 3), parse_layout("tp=3", 3)):
        assert rank_boxes((37, 16), False, target) == [Box.full((37, 16))] * 3
        assert rank_boxes((), True, target) == [Box.full(())] * 3
    assert rank_boxes((37, 16), True, parse_layout("ddp", 3)) == [Box.full((37, 16))] * 3


def test_tp_convention():
    t = parse_layout("tp=2,dp=2", 4)  # rank = dp * 2 + tp
    # 37 rows: TP blocks 19/18, FSDP splits them 10/9 and 9/9 (DESIGN.md's 2-D case)
    rows = [(rank_box((37, 16), True, t, r).start[0], rank_box((37, 16), True, t, r).stop[0]) for r in range(4)]
    assert rows == [(0, 10), (19, 28), (10, 19), (28, 37)]
    # a 1-D tensor is replicated over TP and split over DP only
    rows = [(rank_box((24,), True, t, r).start[0], rank_box((24,), True, t, r).stop[0]) for r in range(4)]
    assert rows == [(0, 12), (0, 12), (12, 24), (12, 24)]


def test_tp_blocks_and_what_cannot_work_match_torchs_strided_shard():
    """Where FSDP2's nested blocks are what torch's _StridedShard metadata describes, our boxes
    equal torch's; where they are not, ``strided_mismatch`` says so (the restore then refuses
    the DTensor: its local shape differs from the computed block)."""
    agree = disagree = 0
    for n, tp, dp in itertools.product(range(0, 50), (1, 2, 3, 4), (1, 2, 3, 4)):
        target = TargetLayout("tp", tp * dp, tp, dp)
        placements = [_StridedShard(0, split_factor=tp), Shard(0)]
        same = True
        for d, t in itertools.product(range(dp), range(tp)):
            shape, offset = _compute_local_shape_and_global_offset((n, 3), (dp, tp), [d, t], placements)
            box = rank_box((n, 3), True, target, d * tp + t)
            if shape[0] != box.shape[0] or (shape[0] and offset[0] != box.start[0]):
                same = False
        assert same == (strided_mismatch(n, tp, dp) is None), (n, tp, dp)
        agree += same
        disagree += not same
    assert agree and disagree


def test_validate_names_the_tensor_that_cannot_be_split():
    tensors = {
        "model/w": entry("model/w", (13, 4), (4, 4)),
        "model/norm": entry("model/norm", (13,), (4,)),  # 1-D: split over dp only, always fine
    }
    with pytest.raises(LayoutError, match=r"key 'model/w': dim 0 of 13 rows cannot be split over tp=2 x dp=3"):
        validate(tensors, parse_layout("tp=2,dp=3", 6), "job/step_1")
    validate(tensors, parse_layout("tp=2,dp=2", 4))
    validate(tensors, parse_layout("fsdp", 6))  # FSDP2 takes uneven and empty blocks
    validate(tensors, parse_layout("tp=6", 6))  # TP alone: plain torch.chunk
    validate({"model/norm": tensors["model/norm"]}, parse_layout("tp=2,dp=3", 6))
    with pytest.raises(LayoutError, match="model/w"):
        plan_reads_for(tensors, parse_layout("tp=2,dp=3", 6))


def test_sharded_keys():
    saved_fsdp = {
        "model/w": entry("model/w", (8, 2), (2, 2)),
        "model/buf": entry("model/buf", (8,), (8,), placements="replicated"),
        "optim/step": entry("optim/step", (), (), placements="replicated"),
    }
    assert sharded_keys(saved_fsdp) == {"model/w"}
    for placements, sharded in [
        ("S(0)", True),
        ("_S(0, 2),S(0)", True),
        ("R,S(1)", True),
        ("Shard(dim=0)", True),
        ("R", False),
        ("replicated", False),
        ("P(sum)", False),
        ("", False),
    ]:
        assert saved_sharded(placements) is sharded, placements
    single = {k: TensorEntry(k, e.layout, "") for k, e in saved_fsdp.items()}
    assert sharded_keys(single) == {"model/w", "model/buf"}  # 0-d never


# ------------------------------------------------------------------------------ read plans


def test_read_plan_of_a_4_rank_fsdp_checkpoint_at_3_ranks():
    # saved by FSDP at 4: 37 rows in shards of 10 (10/10/10/7), one chunk per shard
    tensors = {
        "w": entry("w", (37, 16), (10, 16)),
        "step": entry("step", (), (), placements="replicated"),
    }
    plan = plan_reads_for(tensors, parse_layout("fsdp", 3))
    row, chunk = 16 * 4, 10 * 16 * 4 + CRC_BYTES
    # rank 0 needs rows 0-12 (shards 0, 1), rank 1 rows 13-25 (shards 1, 2), rank 2 rows 26-36 (2, 3)
    assert [c.objects for c in plan.ranks] == [3, 3, 3]  # + the scalar
    assert [c.bytes for c in plan.ranks] == [2 * chunk + 8] * 3
    assert [c.needed for c in plan.ranks] == [13 * row + 4, 13 * row + 4, 11 * row + 4]
    assert plan.largest.rank == 0
    assert plan.needed == 37 * row + 3 * 4
    assert plan.ranks[2].amplification == pytest.approx((2 * chunk + 8) / (11 * row + 4))
    assert plan.amplification > 1.4
    js = plan.to_json()
    assert js["largest_rank"]["rank"] == 0 and len(js["ranks"]) == 3

    everything = plan_reads_for(tensors, parse_layout("ddp", 3))
    assert {c.bytes for c in everything.ranks} == {4 * chunk + 8}
    assert {c.objects for c in everything.ranks} == {5}

    same = plan_reads_for(tensors, parse_layout("fsdp", 4))  # the saved layout: whole chunks
    assert [c.bytes - c.needed for c in same.ranks[:3]] == [CRC_BYTES + 4] * 3


def test_plan_is_per_rank_and_handles_empty_ranks():
    tensors = {"w": entry("w", (3, 4), (1, 4))}
    plan = plan_reads_for(tensors, parse_layout("fsdp", 5))
    assert [c.needed for c in plan.ranks] == [16, 16, 16, 0, 0]
    assert [c.objects for c in plan.ranks] == [1, 1, 1, 0, 0]
    assert plan.ranks[4].amplification == 1.0


# ------------------------------------------------------------------------ rechunked layout


def _assert_whole_chunks(layout: ArrayLayout, boxes):
    for box in boxes:
        if box.empty:
            continue
        assert whole_chunks(layout, box), (layout, box)
        for sr in plan_reads(layout, box):
            for c in sr.chunks:
                cb = chunk_box(layout, sr.shard, c)
                assert cb.intersect(box) == cb


@pytest.mark.parametrize(
    "shape,layout,ws",
    [
        ((37, 16), "fsdp", 3),
        ((37, 16), "fsdp", 4),
        ((4, 8), "fsdp", 6),  # empty ranks
        ((40, 16), "tp=2,dp=2", 4),  # an even 2-D grid
        ((14, 16), "tp=2,dp=3", 6),  # 3/3/1 per TP block: the blocks' common divisor grid
        ((6000, 1024), "fsdp", 4),  # 23 MiB: shards of 1500 rows (6 MiB, one chunk each)
        ((24,), "tp=2,dp=2", 4),
    ],
)
def test_aligned_layout_gives_whole_chunks(shape, layout, ws):
    target = parse_layout(layout, ws)
    boxes = rank_boxes(shape, True, target)
    lay = aligned_layout(shape, "float32", 4, boxes)
    _assert_whole_chunks(lay, boxes)
    for box in boxes:  # what is fetched is what is needed, plus crc32c and edge padding
        nbytes, _ = read_cost(lay, box)
        chunks = sum(len(sr.chunks) for sr in plan_reads(lay, box))
        padding = chunks * lay.chunk_nbytes - box.volume * 4
        assert nbytes == box.volume * 4 + chunks * CRC_BYTES + padding
        if box.stop[0] < shape[0]:  # only the array's last chunk can be padded
            assert padding == 0


def test_aligned_layout_of_a_big_tensor_keeps_whole_rows_in_bounded_chunks():
    boxes = rank_boxes((6000, 1024), True, parse_layout("fsdp", 3))
    lay = aligned_layout((6000, 1024), "float32", 4, boxes)  # 7.8 MiB per rank
    assert lay.shard_shape == (2000, 1024) and lay.chunk_shape[1:] == (1024,)
    assert 2000 % lay.chunk_shape[0] == 0 and 64 << 10 <= lay.chunk_shape[0] * 4096 <= 4 << 20
    _assert_whole_chunks(lay, boxes)


def test_aligned_layout_falls_back_to_an_even_grid_when_blocks_share_no_coarse_grid():
    shape = (37, 16)  # 10/9/9/9 rows under tp=2,dp=2: common divisor 1, 37 one-row objects
    boxes = rank_boxes(shape, True, parse_layout("tp=2,dp=2", 4))
    lay = aligned_layout(shape, "float32", 4, boxes)
    assert lay.shard_shape == (10, 16)
    assert not all(whole_chunks(lay, b) for b in boxes)


def test_aligned_layout_of_replicated_and_empty_tensors():
    lay = aligned_layout((5, 3), "float32", 4, [Box.full((5, 3))] * 3)
    assert lay.shard_shape == (5, 3)
    lay = aligned_layout((0, 3), "float32", 4, [Box.full((0, 3))] * 3)
    assert lay.nbytes == 0


# -------------------------------------------------------------------------- data position


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("consumed,m", [(0, 3), (7, 3), (10, 4), (36, 2), (37, 3), (1, 5)])
def test_sampler_resume_matches_the_elastic_sampler(consumed, m, shuffle, drop_last):
    n = 37
    s = ElasticSampler(n, shuffle=shuffle, seed=5, drop_last=drop_last, rank=0, num_replicas=1)
    it = iter(s)
    for _ in range(consumed):
        next(it)
    state = s.state_dict()
    order = list(ElasticSampler(n, shuffle=shuffle, seed=5, rank=0, num_replicas=1))
    resume = sampler_resume("sampler", state, m)
    assert resume.position == consumed and resume.finished == (consumed == n)
    for r, (at, left) in enumerate(resume.ranks):
        ranked = ElasticSampler(n, shuffle=shuffle, seed=5, drop_last=drop_last, rank=r, num_replicas=m)
        ranked.load_state_dict(state)
        got = list(ranked)
        assert len(got) == left
        if left:
            assert got[0] == order[at]


def test_find_samplers_in_a_state_tree():
    sampler = ElasticSampler(10, rank=0, num_replicas=1).state_dict()
    tree = {
        "model": {"kind": "module", "data": {"w": {"$tensor": "model/w"}}},
        "sampler": {"kind": "stateful", "data": sampler},
        "loop": {"kind": "dict", "data": {"inner": {**sampler, "position": 4}, "other": {"epoch": 1}}},
        "meta": {"kind": "value", "data": 3},
    }
    found = find_samplers(tree)
    assert [p for p, _ in found] == ["sampler", "loop/inner"]
    resumes = remap_data_position(tree, 2)
    assert [r.position for r in resumes] == [0, 4]
    assert resumes[1].to_json()["ranks"] == [
        {"rank": 0, "resumes_at": 4, "samples_left": 3},
        {"rank": 1, "resumes_at": 5, "samples_left": 3},
    ]
    assert remap_data_position({"model": tree["model"]}, 2) == []
