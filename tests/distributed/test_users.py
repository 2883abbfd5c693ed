"""What users train with, across world sizes, in real gloo ranks (``user_scenarios``):

- float8 DTensors (every float8 dtype and float4_e2m1fn_x2, every bit pattern) and an FSDP2
  module with a float8 weight, saved at 2 ranks, restored bitwise at 1 and at 3; the smallest
  are gathered into one shard (a point-to-point transfer of float8 over gloo);
- DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam)`` with two parameter groups,
  saved at 2 ranks as it is held (each rank writes its partition's state), restored at 2, 1
  and 3 (another partition each): the whole optimizer state, as ``consolidate_state_dict``
  gathers it, is bitwise the state at save; one more step then matches the uninterrupted run
  (bitwise at 2 ranks; to float rounding at 1 and 3, where DDP reduces gradients in another
  order). The same checkpoint restores into a plain ``torch.optim.Adam``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.distributed import launch
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIOS = "tests.distributed.user_scenarios"


@pytest.mark.parametrize("dst", [1, 3])
def test_float8_dtensors_restore_bitwise_at_another_world_size(float8_saved, dst):
    out, root = float8_saved
    results = launch.run(dst, "float8_restore", out, scenarios=SCENARIOS, root=root)
    assert len(results) == dst
    for r in results:
        assert r["step"] == 1 and r["checked"] == 13
        assert r["mismatches"] == [], r["mismatches"]


@pytest.fixture(scope="module")
def float8_saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    root = str(out / "ck")
    (r0, _) = launch.run(2, "float8_save", out, scenarios=SCENARIOS, root=root)
    assert set(r0["placements"].values()) == {"(Shard(dim=0),)"}
    return out, root


@pytest.fixture(scope="module")
def zero_saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    root = str(out / "ck")
    saved = launch.run(2, "zero_save", out, scenarios=SCENARIOS, root=root, dist=True)
    return out, root, saved


@pytest.mark.parametrize("dst,in_place", [(2, False), (1, False), (3, False), (3, True)])
def test_zero_redundancy_optimizer_restores_bitwise_at_any_world_size(zero_saved, dst, in_place):
    out, root, saved = zero_saved
    results = launch.run(dst, "zero_restore", out, scenarios=SCENARIOS, root=root, dist=True, in_place=in_place)
    r0 = results[0]
    assert r0["step"] == 2
    assert r0["mismatches"] == [], r0["mismatches"]
    # each rank holds only its partition's state: 6 parameters x (exp_avg, exp_avg_sq, step)
    assert sum(r["owned_state_entries"] for r in results) == 18
    if dst > 1:
        assert max(r["owned_state_entries"] for r in results) < 18
    if dst == 2:
        assert r0["next_bitwise"] == [], r0["next_bitwise"]
        assert r0["next_loss"] == saved[0]["next_loss"]
    else:
        assert r0["next_max_diff"] < 1e-6
        assert r0["next_loss"] == pytest.approx(saved[0]["next_loss"], rel=1e-6)


def test_a_zero_checkpoint_restores_into_a_plain_optimizer(zero_saved):
    out, root, _ = zero_saved
    net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3))
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in net.named_parameters() if n.endswith("bias")]
    optim = torch.optim.Adam(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, foreach=False
    )
    with Checkpointer(root) as ck:
        assert ck.restore({"model": net, "optim": optim}) == 2
    ref = torch.load(out / "zero_ref.pt", weights_only=False)["at_save"]
    sd = optim.state_dict()
    assert sd["param_groups"] == ref["param_groups"]
    assert set(sd["state"]) == set(ref["state"])
    for i, s in ref["state"].items():
        for k, v in s.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    for k, v in ref["params"].items():
        assert torch.equal(net.state_dict()[k], v), k


def test_zero_set_ups_that_cannot_be_saved_say_what_to_do(tmp_path):
    results = launch.run(2, "zero_refusals", tmp_path, scenarios=SCENARIOS, root=str(tmp_path / "ck"))
    for r in results:
        assert "overlap_with_ddp=False" in r["overlap"]
        assert "subgroup of the job is not supported" in r["subgroup"]
        assert r["latest"] is None


def test_zero_with_parameters_as_bucket_view_restores_at_another_world_size(tmp_path):
    """``parameters_as_bucket_view=True``: the parameters are views into ZeRO's flat buckets; a
    restore at 3 ranks writes into those views and the state is bitwise."""
    root = str(tmp_path / "ck")
    saved = launch.run(2, "zero_save", tmp_path, scenarios=SCENARIOS, root=root, dist=True, bucket_view=True)
    (r0, *_) = launch.run(3, "zero_restore", tmp_path, scenarios=SCENARIOS, root=root, dist=True, bucket_view=True)
    assert r0["step"] == 2 and r0["mismatches"] == [], r0["mismatches"]
    assert r0["next_loss"] == pytest.approx(saved[0]["next_loss"], rel=1e-6)
