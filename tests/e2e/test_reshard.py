"""``ckptd reshard`` end to end, on real checkpoints.

Fast tests use a single-process checkpoint (``main([...])`` in-process, a restore at world size
1 through the plan). The slow ones save with FSDP2 at 4 real processes (gloo) and restore at 3:
one launch to save, one to restore after a plain ``reshard --to 3``, one after ``--rechunk``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.cli.main import main
from ckptd.codec import CRC_BYTES
from ckptd.errors import CheckpointError
from ckptd.layout import chunk_box, plan_reads, read_cost
from ckptd.plans import plan_key, planned_source
from ckptd.reshard import parse_layout, rank_box, sharded_keys
from ckptd.verify import verify
from storage_backends import open_store
from tests.distributed import launch
from trainer_hooks import Checkpointer, ElasticSampler

pytestmark = pytest.mark.timeout(300)

STEP = 7


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptd: error: ")
    return lines[0]


def digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256: what "unchanged" means."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(37, 16), torch.nn.Linear(16, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    sampler = ElasticSampler(100, shuffle=True, seed=3, rank=0, num_replicas=1)
    return {"model": model, "optim": opt, "sampler": sampler, "extra": {"odd": torch.randn(13, 4)}}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A job root with one committed step saved by one process, its sampler 10 samples in."""
    root = tmp_path_factory.mktemp("reshard") / "job"
    state = _state(0)
    it = iter(state["sampler"])
    for _ in range(10):
        next(it)
    with Checkpointer(str(root)) as ck:
        ck.save(STEP, state).result()
    return root, state


@pytest.fixture
def root(single, tmp_path):
    dst = tmp_path / "job"
    shutil.copytree(single[0], dst)
    return dst


# ----------------------------------------------------------------------------------- plan


def test_plan_is_printed_and_recorded_and_the_checkpoint_is_unchanged(root, capsys):
    before = digest(root)
    rc, out, err = run(capsys, "reshard", root, "--to", 3)
    assert rc == 0, err
    lines = out.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("RANK")))
    assert lines[head].split() == ["RANK", "READS", "OBJECTS", "NEEDS", "AMPLIFICATION"]
    assert [ln.split()[0] for ln in lines[head + 1 : head + 4]] == ["0", "1", "2"]
    assert lines[head + 4].startswith("largest: rank ")
    assert "fsdp over 3 ranks" in out and ": OK" in out
    assert "'sampler' (ElasticSampler), epoch 0, position 10 of 100" in out
    assert "world-size independent, nothing to rewrite" in out
    assert "reads the checkpoint itself" in out

    plan = json.loads((root / plan_key(STEP, 3)).read_text())
    assert plan["step"] == STEP and plan["world_size"] == 3 and plan["saved_world_size"] == 1
    assert plan["layout"]["spec"] == "fsdp" and "use_step" not in plan
    ranks = plan["reads"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert plan["reads"]["largest_rank"] == max(ranks, key=lambda r: r["bytes"])
    sampler = plan["data_position"]["samplers"][0]
    assert sampler["key"] == "sampler" and sampler["position"] == 10
    assert [r["samples_left"] for r in sampler["ranks"]] == [30, 30, 30]
    assert [r["resumes_at"] for r in sampler["ranks"]] == [10, 11, 12]

    # nothing of the checkpoint changed, and the job root still lists one checkpoint
    assert {k: v for k, v in digest(root).items() if not k.startswith(mf.PLANS)} == before
    assert catalog.steps(open_store(str(root))) == [STEP]


def test_json_output_is_the_plan_record(root, capsys):
    rc, out, err = run(capsys, "reshard", root, "--to", 2, "--layout", "ddp", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    saved = json.loads((root / doc["plan_path"]).read_text())
    assert doc.pop("plan_path") == plan_key(STEP, 2)
    assert doc == saved
    assert doc["layout"]["kind"] == "replicated"
    assert len({r["bytes"] for r in doc["reads"]["ranks"]}) == 1  # everyone reads everything


def test_layouts_that_cannot_work_exit_1_with_the_reason(root, capsys):
    rc, out, err = run(capsys, "reshard", root, "--to", 4, "--layout", "tp=3")
    assert rc == 1 and out == ""
    assert "tp=3 does not divide world size 4" in one_error_line(err)
    rc, out, err = run(capsys, "reshard", root, "--to", 4, "--layout", "tp=2,dp=3")
    assert rc == 1 and "2 x 3 = 6 ranks, but the job has 4" in one_error_line(err)
    # 13 rows over tp=2 x dp=3: FSDP2's blocks are not what torch's DTensor metadata says
    rc, out, err = run(capsys, "reshard", root, "--to", 6, "--layout", "tp=2,dp=3")
    assert rc == 1 and "key 'extra/odd': dim 0 of 13 rows cannot be split" in one_error_line(err)
    assert not (root / mf.PLANS).exists()


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--to", "0"], "invalid count 0"),
        (["--to", "x"], "invalid count 'x'"),
        (["--to", "3", "--layout", "tp=two"], "invalid layout 'tp=two'"),
        ([], "--to"),
    ],
)
def test_bad_usage_exits_2(root, capsys, argv, msg):
    rc, out, err = run(capsys, "reshard", root, *argv)
    assert rc == 2 and out == "" and msg in err


def test_missing_checkpoint_exits_1(tmp_path, capsys):
    rc, _, err = run(capsys, "reshard", tmp_path / "nothing", "--to", 2)
    assert rc == 1 and "no committed checkpoint" in one_error_line(err)


# -------------------------------------------------------------------------------- rechunk


def test_rechunk_writes_a_verified_copy_that_restore_uses(single, root, capsys, caplog):
    before = digest(root / mf.step_dir(STEP))
    rc, out, err = run(capsys, "reshard", root, "--to", 1, "--rechunk")
    assert rc == 0, err
    copy_root = root / "_rechunked" / "to_1_fsdp"
    assert f"wrote a new committed checkpoint (rechunked, verified): {copy_root}/{mf.step_dir(STEP)}" in out
    assert "reads the rechunked copy through it" in out
    plan = json.loads((root / plan_key(STEP, 1)).read_text())
    assert plan["use_step"] == STEP and plan["use_root"] == "_rechunked/to_1_fsdp"
    with open_store(str(copy_root)) as sub:
        assert verify(sub, STEP).ok
        assert catalog.load_manifest(sub, STEP).world_size == 1
    assert digest(root / mf.step_dir(STEP)) == before
    assert catalog.steps(open_store(str(root))) == [STEP]  # ls of the job root is unchanged

    rc, out, _ = run(capsys, "reshard", root, "--to", 1, "--rechunk")
    assert rc == 0 and "already written" in out

    # Prove that the restore reads the copy: drop the original's data (a test-only sabotage).
    shutil.rmtree(root / mf.step_dir(STEP) / mf.ARRAYS)
    fresh = _state(1)
    with caplog.at_level(logging.INFO, logger="ckptd.restore"), Checkpointer(str(root)) as ck:
        assert ck.restore(fresh) == STEP
        assert "rechunked copy" in caplog.text
        with pytest.raises(CheckpointError, match="missing"):
            ck.restore(_state(2), step=STEP)  # an explicit step never follows a plan
    want = single[1]
    for a, b in zip(want["model"].state_dict().values(), fresh["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(want["optim"].state.values(), fresh["optim"].state.values(), strict=True):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["step"], q["step"])
    assert torch.equal(want["extra"]["odd"], fresh["extra"]["odd"])
    assert fresh["sampler"].position == 10


def test_planned_source_ignores_plans_it_cannot_follow(root, capsys, caplog):
    store = open_store(str(root))
    assert planned_source(store, STEP, 2) is None  # no plan
    assert run(capsys, "reshard", root, "--to", 2)[0] == 0
    assert planned_source(store, STEP, 2) is None  # a plan without a copy
    assert run(capsys, "reshard", root, "--to", 2, "--rechunk")[0] == 0
    assert planned_source(store, STEP, 2) == f"{root}/_rechunked/to_2_fsdp"
    assert planned_source(store, STEP, 3) is None  # another world size

    key = root / plan_key(STEP, 2)
    good = json.loads(key.read_text())
    caplog.set_level(logging.WARNING, logger="ckptd.plans")
    for bad in ({**good, "use_root": "../../elsewhere"}, {**good, "use_root": "/abs"}, {**good, "use_step": 99}):
        key.write_text(json.dumps(bad))
        assert planned_source(store, STEP, 2) is None
    key.write_text("{not json")
    assert planned_source(store, STEP, 2) is None
    key.write_text(json.dumps(good))
    os.remove(root / "_rechunked" / "to_2_fsdp" / mf.step_dir(STEP) / mf.COMMIT)
    assert planned_source(store, STEP, 2) is None
    assert "not committed" in caplog.text and "not valid JSON" in caplog.text


# ------------------------------------------------------------------ 4 FSDP ranks -> 3 ranks


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory):
    """A checkpoint saved by FSDP2 at 4 ranks (vocabulary 37: 10/10/10/7 rows), and the full
    state it holds (``ref_fsdp_4.pt`` in the work folder)."""
    work = tmp_path_factory.mktemp("reshard4")
    root = work / "ck"
    res = launch.run(4, "save", work, layout="fsdp", roots=[str(root)])
    return work, root, res[0]["saved_step"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reshard_to_3_then_a_3_rank_restore_is_bitwise(fsdp4, capsys):
    work, saved_root, step = fsdp4
    root = work / "plain"
    shutil.copytree(saved_root, root)
    rc, out, err = run(capsys, "reshard", root, "--to", 3)
    assert rc == 0, err
    assert "saved at world size 4" in out and "largest: rank" in out
    rows = [ln.split() for ln in out.splitlines() if ln[:4].strip().isdigit()]
    assert [r[0] for r in rows[:3]] == ["0", "1", "2"]

    # what cannot work on this checkpoint: tp=2 x dp=3 splits the 37-row embedding unevenly
    rc, out, err = run(capsys, "reshard", root, "--to", 6, "--layout", "tp=2,dp=3")
    assert rc == 1 and "'model/emb.weight': dim 0 of 37 rows cannot be split" in one_error_line(err)

    res = launch.run(3, "restore", work, layout="fsdp", root=str(root), ref="ref_fsdp_4.pt")
    assert res[0]["step"] == step
    assert res[0]["mismatches"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rechunk_to_3_reads_whole_chunks_and_restores_bitwise(fsdp4, capsys):
    work, saved_root, step = fsdp4
    root = work / "rechunk"
    shutil.copytree(saved_root, root)
    before = digest(root / mf.step_dir(step))
    rc, out, err = run(capsys, "reshard", root, "--to", 3, "--rechunk")
    assert rc == 0, err
    assert "wrote a new committed checkpoint" in out
    assert digest(root / mf.step_dir(step)) == before
    assert catalog.steps(open_store(str(root))) == [step]

    with open_store(str(root / "_rechunked" / "to_3_fsdp")) as sub:
        assert verify(sub, step).ok
        copy = catalog.load_manifest(sub, step)
    original = catalog.load_manifest(open_store(str(root)), step)
    target = parse_layout("fsdp", 3)
    sharded = sharded_keys(copy.tensors)
    assert "model/emb.weight" in sharded and sharded == sharded_keys(original.tensors)
    partial_before = 0
    for rank in range(3):
        for key, e in copy.tensors.items():
            box = rank_box(e.layout.shape, key in sharded, target, rank)
            if box.empty:
                continue
            chunks = 0
            for sr in plan_reads(e.layout, box):
                for c in sr.chunks:
                    cb = chunk_box(e.layout, sr.shard, c)
                    assert cb.intersect(box) == cb, (rank, key, cb, box)  # a whole chunk
                    chunks += 1
            nbytes, _ = read_cost(e.layout, box)
            padding = nbytes - chunks * CRC_BYTES - box.volume * e.layout.itemsize
            assert padding == 0 or box.stop[0] == e.layout.shape[0], (rank, key)  # only the array's edge
            o = original.tensors[key]
            partial_before += read_cost(o.layout, box)[0] > box.volume * o.layout.itemsize + CRC_BYTES * 4
    assert partial_before  # the 4-rank checkpoint did make 3 ranks read parts of chunks

    # the restore at 3 goes through the plan: drop the original's data to prove it
    shutil.rmtree(root / mf.step_dir(step) / mf.ARRAYS)
    res = launch.run(3, "restore", work, layout="fsdp", root=str(root), ref="ref_fsdp_4.pt")
    assert res[0]["step"] == step
    assert res[0]["mismatches"] == []
