"""Save at one world size and layout, restore at another: every parameter and optimizer state
comes back bitwise equal to the full state gathered before the save, and training continues.

Real processes (gloo on CPU), a real filesystem and a real S3-compatible server on loopback.
The toy model's vocabulary (37 rows) splits unevenly over 2, 3 and 4 ranks, and its 2-D
FSDP x TP layout puts 10/9/9/9 rows on the four ranks: blocks that tile no regular grid.
"""

from __future__ import annotations

import uuid

import pytest

from tests.distributed import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# (saving layout, saving world size, restoring layout, restoring world size)
CASES = [
    ("fsdp", 4, "fsdp", 1),
    ("fsdp", 4, "fsdp", 2),
    ("fsdp", 4, "fsdp", 3),
    ("fsdp", 4, "fsdp", 4),
    ("fsdp", 3, "fsdp", 4),
    ("ddp", 2, "fsdp", 3),
    ("fsdp", 2, "tp", 2),
    ("tp", 2, "2d", 4),
    ("single", 1, "fsdp", 2),
    ("2d", 4, "single", 1),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def s3_root(s3_server):
    import boto3

    bucket = f"ckptd-reshard-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


@pytest.fixture(scope="module")
def saved(workdir, s3_root):
    """Runs each saving job once, writing the same checkpoint to a local root and an S3 root."""
    cache: dict[tuple[str, int], dict] = {}

    def get(layout: str, ws: int) -> dict:
        if (layout, ws) not in cache:
            roots = {"file": str(workdir / f"ck_{layout}_{ws}"), "s3": f"{s3_root}/ck_{layout}_{ws}"}
            res = launch.run(ws, "save", workdir, layout=layout, roots=list(roots.values()))
            cache[(layout, ws)] = {"roots": roots, "result": res[0], "ref": f"ref_{layout}_{ws}.pt"}
        return cache[(layout, ws)]

    return get


@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.s3)])
@pytest.mark.parametrize("src,src_ws,dst,dst_ws", CASES, ids=[f"{a}{b}-to-{c}{d}" for a, b, c, d in CASES])
def test_restore_is_bitwise_and_training_continues(saved, workdir, backend, src, src_ws, dst, dst_ws):
    s = saved(src, src_ws)
    res = launch.run(dst_ws, "restore", workdir, layout=dst, root=s["roots"][backend], ref=s["ref"])
    r0 = res[0]
    assert r0["step"] == s["result"]["saved_step"]
    assert r0["mismatches"] == [], f"tensors differ after restore: {r0['mismatches']}"
    assert r0["sched_last_epoch"] == s["result"]["saved_step"] + 2  # restored 2, then one step
    assert r0["meta"] == {"seed": 0}  # JSON state came back, not the new job's value
    if (src, src_ws) == (dst, dst_ws):
        # same world size and layout: the next step is exactly the uninterrupted run's
        assert r0["next_loss"] == s["result"]["next_loss"]
    else:
        # another world size reduces in another order: equal up to float rounding
        assert r0["next_loss"] == pytest.approx(s["result"]["next_loss"], rel=1e-5)
    assert len({r["next_loss"] for r in res}) == 1  # every rank agrees


IN_PLACE_CASES = [("fsdp", 4, "fsdp", 3), ("tp", 2, "2d", 4), ("2d", 4, "single", 1)]


@pytest.mark.parametrize(
    "src,src_ws,dst,dst_ws", IN_PLACE_CASES, ids=[f"{a}{b}-to-{c}{d}" for a, b, c, d in IN_PLACE_CASES]
)
def test_in_place_restore_is_bitwise_across_world_sizes(saved, workdir, src, src_ws, dst, dst_ws):
    """``restore(in_place=True)`` reads into the live DTensors' local shards: same values."""
    s = saved(src, src_ws)
    res = launch.run(dst_ws, "restore", workdir, layout=dst, root=s["roots"]["file"], ref=s["ref"], in_place=True)
    assert res[0]["step"] == s["result"]["saved_step"]
    assert res[0]["mismatches"] == [], f"tensors differ after restore: {res[0]['mismatches']}"
    assert res[0]["next_loss"] == pytest.approx(s["result"]["next_loss"], rel=1e-5)
    assert len({r["next_loss"] for r in res}) == 1


def test_fsdp_save_shards_weights_and_gathers_small_tensors(saved):
    """At 4 FSDP ranks the weights are one shard per rank (the ranks' blocks), while tensors at
    or under the gather size (CKPTD_GATHER_SMALL_BYTES, 128 B in these workers) are one object
    written by one rank that received the other blocks: fewer, not tinier, objects."""
    from ckptd import catalog
    from ckptd.manifest import step_dir
    from storage_backends import open_store

    store = open_store(saved("fsdp", 4)["roots"]["file"])
    m = catalog.load_manifest(store)
    emb, bias = m.tensors["model/emb.weight"].layout, m.tensors["model/fc1.bias"].layout
    assert emb.shape == (37, 16) and emb.shard_shape == (10, 16)  # torch.chunk: 10/10/10/7
    assert bias.shard_shape == bias.shape == (24,)
    emb_objects = [k for k in store.list(f"{step_dir(m.step)}/arrays/model/emb.weight/") if "/c/" in k.key]
    bias_objects = [k for k in store.list(f"{step_dir(m.step)}/arrays/model/fc1.bias/") if "/c/" in k.key]
    assert len(emb_objects) == 4 and len(bias_objects) == 1
    exp_avg = m.tensors["optim/state/fc1.bias/exp_avg"].layout
    assert exp_avg.shard_shape == exp_avg.shape


@pytest.mark.s3
@pytest.mark.parametrize("src,src_ws,dst,dst_ws", [("ddp", 2, "fsdp", 3)], ids=["ddp2-to-fsdp3"])
def test_restore_from_ceph_rgw(rgw_bucket, tmp_path, src, src_ws, dst, dst_ws):
    """One representative case against a real Ceph RADOS Gateway (tests/rgwserver.py): the
    ranks' processes inherit the AWS_* variables ``rgw_bucket`` points at RGW."""
    root = f"{rgw_bucket}/ck_{src}_{src_ws}"
    saved = launch.run(src_ws, "save", tmp_path, layout=src, roots=[root])[0]
    res = launch.run(dst_ws, "restore", tmp_path, layout=dst, root=root, ref=f"ref_{src}_{src_ws}.pt")
    assert res[0]["step"] == saved["saved_step"]
    assert res[0]["mismatches"] == [], f"tensors differ after restore: {res[0]['mismatches']}"
    assert res[0]["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-5)
    assert len({r["next_loss"] for r in res}) == 1
