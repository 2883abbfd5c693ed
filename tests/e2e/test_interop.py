"""``ckptd import`` / ``ckptd export`` in one process: torch.save, safetensors (single and
sharded), DCP (plain and torchtitan-style), DeepSpeed universal; that they stream (peak RSS of a
child process far below the checkpoint's size); and their errors. Multi-process DCP interop is in
tests/distributed/test_interop.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ckptd.cli.main import main
from trainer_hooks import Checkpointer

safetensors_torch = pytest.importorskip("safetensors.torch", reason="the interop extra (safetensors) is not installed")

ROOT = Path(__file__).resolve().parents[2]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.register_buffer("counts", torch.arange(7))  # int64
        self.register_buffer("scale", torch.linspace(0, 1, 4).to(torch.bfloat16))


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def trained(seed: int = 0):
    m = net(seed)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m.norm(m.fc(m.emb(torch.arange(11)))).square().mean().backward()
        o.step()
    return m, o


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def ok(capsys, *argv) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    return out


def equal_sd(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def full_optim(m, o) -> dict:
    osd = get_optimizer_state_dict(m, o, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}/{k}": v for fqn, s in osd["state"].items() for k, v in s.items()}


def restore_fresh(root: str, optim_key: str, **values) -> tuple[Net, torch.optim.AdamW]:
    """Restore ``root`` into a fresh Net (other weights) under ``model``, a fresh AdamW (lr 0.5)
    under ``optim_key`` and ``values`` under their own keys."""
    m2 = net(4)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    Checkpointer(root).restore({"model": m2, optim_key: o2, **values})
    return m2, o2


def dcp_save(sd: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def dcp_load(sd: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job root with step 7: {"model": Net, "optim": AdamW, "extra": {...}}."""
    root = str(tmp_path_factory.mktemp("interop") / "job")
    m, o = trained()
    extra = {"ids": torch.arange(3), "note": "hi", "flag": torch.tensor([True, False])}
    ck = Checkpointer(root)
    ck.save(7, {"model": m, "optim": o, "extra": extra}).result()
    ck.close()
    return root, m, o


# ----------------------------------------------------------------------------------- export


def test_export_safetensors_loads_with_load_file(saved, tmp_path, capsys):
    root, m, _ = saved
    out = tmp_path / "net.safetensors"
    ok(capsys, "export", root, "--format", "safetensors", out)
    assert equal_sd(safetensors_torch.load_file(out), m.state_dict())
    # a folder OUT gets model.safetensors
    ok(capsys, "export", root, "--step", 7, "--format", "safetensors", tmp_path / "folder")
    assert equal_sd(safetensors_torch.load_file(tmp_path / "folder" / "model.safetensors"), m.state_dict())


def test_export_safetensors_sharded_has_a_valid_index(saved, tmp_path, capsys):
    root, m, _ = saved
    out = tmp_path / "hf"
    printed = ok(capsys, "export", root, "--format", "safetensors", out, "--max-shard-size", "150B")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sd = m.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and f"in {len(shards) + 1} files" in printed
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, "model.safetensors.index.json"])
    got = {}
    for shard in shards:
        part = safetensors_torch.load_file(out / shard)
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(part)
        got.update(part)
    assert equal_sd(got, sd)
    # and it imports back as it is, through the index
    new_root = str(tmp_path / "job2")
    ok(capsys, "import", out, "--format", "safetensors", new_root, "--step", 1)
    fresh = net(5)
    Checkpointer(new_root).restore({"model": fresh})
    assert equal_sd(fresh.state_dict(), sd)


def test_export_torch_is_a_flat_state_dict(saved, tmp_path, capsys):
    root, m, o = saved
    ok(capsys, "export", root, "--format", "torch", tmp_path / "net.pt")
    assert equal_sd(torch.load(tmp_path / "net.pt", weights_only=True), m.state_dict())
    # --as picks another entry; deeper paths are joined with dots; hyperparameters are left out
    rc, _, err = run(capsys, "export", root, "--format", "torch", tmp_path / "optim.pt", "--as", "optim")
    assert rc == 0 and "left out" in err
    got = torch.load(tmp_path / "optim.pt", weights_only=True)
    want = {f"state.{k.replace('/', '.')}": v for k, v in full_optim(m, o).items()}
    assert equal_sd(got, want)


def test_export_dcp_loads_with_dcp_load(saved, tmp_path, capsys):
    root, m, o = saved
    ok(capsys, "export", root, "--format", "dcp", tmp_path / "dcp")
    m2 = net(3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    sd = {
        "model": get_model_state_dict(m2),
        "optim": get_optimizer_state_dict(m2, o2),
        "extra": {"ids": torch.zeros(3, dtype=torch.int64), "note": "", "flag": torch.zeros(2, dtype=torch.bool)},
    }
    dcp_load(sd, tmp_path / "dcp")
    assert equal_sd(sd["model"], m.state_dict())
    assert sd["optim"]["param_groups"][0]["lr"] == 1e-2
    assert sd["extra"]["note"] == "hi" and sd["extra"]["flag"].tolist() == [True, False]


# ----------------------------------------------------------------------------------- import


def test_torch_save_imports_and_restores_into_a_model(tmp_path, capsys):
    m, _ = trained(1)
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    root = str(tmp_path / "job")
    printed = ok(capsys, "import", tmp_path / "sd.pt", "--format", "torch", root, "--step", 100)
    assert "model (dict)" in printed and "step_0000000100" in printed
    fresh = net(9)
    assert Checkpointer(root).restore({"model": fresh}) == 100
    assert equal_sd(fresh.state_dict(), m.state_dict())
    # --as puts the same tensors under another state key
    ok(capsys, "import", tmp_path / "sd.pt", "--format", "torch", root, "--step", 101, "--as", "net")
    fresh = net(8)
    Checkpointer(root).restore({"net": fresh})
    assert equal_sd(fresh.state_dict(), m.state_dict())


def test_dcp_import_restores_model_optimizer_and_values(tmp_path, capsys):
    m, o = trained(2)
    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o), "extra": {"epoch": 3}}
    dcp_save(sd, tmp_path / "dcp")
    root = str(tmp_path / "job")
    printed = ok(capsys, "import", tmp_path / "dcp", "--format", "dcp", root, "--step", 5, "--trust-pickle")
    assert "model (dict), optim (optimizer), extra (dict)" in printed
    extra = {"epoch": 0}
    m2, o2 = restore_fresh(root, "optim", extra=extra)
    assert equal_sd(m2.state_dict(), m.state_dict())
    assert equal_sd(full_optim(m2, o2), full_optim(m, o))
    assert o2.param_groups[0]["lr"] == 1e-2 and o2.param_groups[0]["betas"] == (0.9, 0.999)
    assert extra == {"epoch": 3}


def test_dcp_import_of_a_torchtitan_layout(tmp_path, capsys):
    """torchtitan saves its model's FQNs at the top level and the optimizer flattened
    (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)."""
    m, o = trained(3)
    osd = get_optimizer_state_dict(m, o, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp_save({**get_model_state_dict(m), "optimizer": osd, "train_state": {"step": 12}}, tmp_path / "tt")
    root = str(tmp_path / "job")
    printed = ok(capsys, "import", tmp_path / "tt", "--format", "dcp", root, "--step", 12, "--trust-pickle")
    assert "model (dict), optimizer (optimizer), train_state (dict)" in printed
    train_state = {"step": 0}
    m2, o2 = restore_fresh(root, "optimizer", train_state=train_state)
    assert equal_sd(m2.state_dict(), m.state_dict())
    assert equal_sd(full_optim(m2, o2), full_optim(m, o))
    assert o2.param_groups[0]["lr"] == 1e-2 and train_state == {"step": 12}


def test_dcp_imported_scheduler_restores_into_a_live_scheduler(tmp_path, capsys):
    m, o = trained(4)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    o.step()
    sched.step()
    dcp_save({"sched": sched}, tmp_path / "dcp")
    root = str(tmp_path / "job")
    ok(capsys, "import", tmp_path / "dcp", "--format", "dcp", root, "--step", 1, "--trust-pickle")
    live = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(net(0).parameters(), lr=1.0), step_size=1)
    state = {"sched": live}
    with Checkpointer(root) as ck:
        ck.restore(state)
    assert state["sched"] is live and live.last_epoch == 1


@contextlib.contextmanager
def _fake_deepspeed_classes():
    """Classes named as DeepSpeed 0.19 names its loss scaler and ZeRO stage enum, for torch.save
    to pickle by those names; removed afterwards, so loading cannot find the real ones."""
    import enum
    import types

    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler"]
    names += ["deepspeed.runtime.zero", "deepspeed.runtime.zero.config"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)

    class LossScaler:
        def __init__(self):
            self.cur_scale = 1.0
            self.dynamic = False

    class ZeroStageEnum(enum.IntEnum):
        optimizer_states = 1
        gradients = 2

    sys.modules["deepspeed.runtime.fp16.loss_scaler"].LossScaler = LossScaler
    LossScaler.__module__, LossScaler.__qualname__ = "deepspeed.runtime.fp16.loss_scaler", "LossScaler"
    sys.modules["deepspeed.runtime.zero.config"].ZeroStageEnum = ZeroStageEnum
    ZeroStageEnum.__module__, ZeroStageEnum.__qualname__ = "deepspeed.runtime.zero.config", "ZeroStageEnum"
    try:
        yield LossScaler, ZeroStageEnum
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


def test_deepspeed_universal_synthetic(tmp_path, capsys):
    """The documented layout of ds_to_universal.py (ZeRO-1/2), built by hand."""
    m, o = trained(6)
    zero = tmp_path / "global_step9_universal" / "zero"
    osd = full_optim(m, o)
    for name, p in m.named_parameters():
        (zero / name).mkdir(parents=True)
        torch.save({"param": p.detach().clone(), "cat_dim": 0}, zero / name / "fp32.pt")
        for state in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": osd[f"{name}/{state}"], "cat_dim": 0}, zero / name / f"{state}.pt")
        torch.save(int(osd[f"{name}/step"].item()), zero / name / "step.pt")
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "bias_correction": True}
    torch.save({"param_groups": [{**group, "params": [0]}], "zero_stage": 2}, zero / "optimizer_state.pt")
    root = str(tmp_path / "job")
    printed = ok(capsys, "import", zero.parent, "--format", "deepspeed-universal", root, "--step", 9)
    assert "model (dict), optim (optimizer)" in printed
    m2 = net(7)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    Checkpointer(root).restore({"model": m2, "optim": o2}, strict=False)  # buffers are not in DeepSpeed's zero/
    assert equal_sd(dict(m2.named_parameters()), dict(m.named_parameters()))
    assert equal_sd(full_optim(m2, o2), full_optim(m, o))
    assert o2.param_groups[0]["lr"] == 1e-2
    m2.fc(torch.ones(6)).sum().backward()
    o2.step()  # the optimizer works with the imported hyperparameters

    # DeepSpeed's own bookkeeping objects (its loss scaler, pickled even in fp32 training) come in
    # as inert records: the optimizer is imported, and no DeepSpeed code runs (none is installed
    # under these names here: the classes below exist only while the file is written)
    with _fake_deepspeed_classes() as (scaler, stage):
        book = {"loss_scaler": scaler(), "zero_stage": stage(2), "param_groups": [{**group, "params": [0]}]}
        torch.save(book, zero / "optimizer_state.pt")
    printed = ok(capsys, "import", zero.parent, "--format", "deepspeed-universal", root, "--step", 12)
    assert "model (dict), optim (optimizer)" in printed
    m3 = net(8)
    o3 = torch.optim.AdamW(m3.parameters(), lr=0.5)
    Checkpointer(root).restore({"model": m3, "optim": o3}, step=12, strict=False)
    assert equal_sd(full_optim(m3, o3), full_optim(m, o))

    # an optimizer_state.pt holding other objects: the weights come in, the optimizer is left out
    torch.save({"param_groups": [{**group, "params": [0]}], "scaler": torch.nn.Identity()}, zero / "optimizer_state.pt")
    rc, out, err = run(capsys, "import", zero, "--format", "deepspeed-universal", root, "--step", 10)
    assert rc == 0 and "optimizer state left out" in err and "optim (optimizer)" not in out
    # ZeRO-3 universal files hold bare flat tensors: without the model states that record their
    # shapes, refused with the reason
    torch.save(torch.zeros(30), zero / "fc.weight" / "fp32.pt")
    rc, _, err = run(capsys, "import", zero, "--format", "deepspeed-universal", root, "--step", 11)
    assert rc == 1 and "ZeRO-3" in err


def test_deepspeed_universal_zero3_synthetic(tmp_path, capsys):
    """ZeRO-3's universal layout, built by hand as ds_to_universal writes it (DeepSpeed 0.19.8,
    checked against its real output in tests/systems/test_deepspeed.py): every zero/<name>/*.pt a
    bare flat tensor, the shapes in ``param_shapes`` of zero_pp_rank_*_model_states.pt beside
    zero/. Imported reshaped, restored bitwise; a flat tensor whose size disagrees with its
    recorded shape is refused, naming both."""
    from collections import OrderedDict

    m, o = trained(6)
    universal = tmp_path / "global_step9_universal"
    zero = universal / "zero"
    osd = full_optim(m, o)
    shapes = OrderedDict()
    for name, p in m.named_parameters():
        (zero / name).mkdir(parents=True)
        torch.save(p.detach().clone().reshape(-1), zero / name / "fp32.pt")
        for state in ("exp_avg", "exp_avg_sq"):
            torch.save(osd[f"{name}/{state}"].reshape(-1), zero / name / f"{state}.pt")
        shapes[name] = p.shape
    # no step.pt: ZeRO-3 keeps the step once, in its flat group's optimizer state
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "bias_correction": True}
    step = osd["fc.weight/step"].clone()
    inner = {"state": {0: {"step": step}}, "param_groups": [group]}
    torch.save(
        {"param_groups": [{**group, "params": [0]}], "zero_stage": 3, "optimizer_state_dict": inner},
        zero / "optimizer_state.pt",
    )
    states = {"param_shapes": [shapes], "frozen_param_shapes": OrderedDict(), "ds_version": "0.19.8"}
    for r in (0, 1):
        torch.save(states, universal / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    root = str(tmp_path / "job")
    printed = ok(capsys, "import", universal, "--format", "deepspeed-universal", root, "--step", 9)
    assert "model (dict), optim (optimizer)" in printed
    m2 = net(7)
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    Checkpointer(root).restore({"model": m2, "optim": o2}, strict=False)
    assert equal_sd(dict(m2.named_parameters()), dict(m.named_parameters()))
    assert equal_sd(full_optim(m2, o2), full_optim(m, o))

    torch.save(torch.zeros(7), zero / "fc.weight" / "exp_avg.pt")  # 7 values, shape says otherwise
    rc, _, err = run(capsys, "import", universal, "--format", "deepspeed-universal", root, "--step", 10)
    assert rc == 1 and "holds 7 values" in err and "fc.weight" in err


@pytest.mark.s3
def test_python_api_reports_progress_and_works_on_s3(s3_bucket, tmp_path):
    """The same code on an object store: import into S3, export from it; progress per tensor."""
    from ckptd.interop import export_checkpoint, import_checkpoint
    from storage_backends import open_store

    m, _ = trained(5)
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    calls: list[tuple[int, int]] = []
    with open_store(s3_bucket) as store:
        res = import_checkpoint(str(tmp_path / "sd.pt"), "torch", store, 3, progress=lambda d, t: calls.append((d, t)))
        n = len(m.state_dict())
        assert res.tensors == n and calls[0] == (0, n) and calls[-1] == (n, n)
        export_checkpoint(store, None, "safetensors", str(tmp_path / "out.safetensors"))
    assert equal_sd(safetensors_torch.load_file(tmp_path / "out.safetensors"), m.state_dict())


# ----------------------------------------------------------------------------------- errors


def test_errors_are_one_line(saved, tmp_path, capsys):
    root, _, _ = saved

    def error(code, *argv):
        rc, _, err = run(capsys, *argv)
        assert rc == code, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptd: error: "), err
        return lines[0]

    assert "no such file" in error(1, "import", tmp_path / "nope.pt", "--format", "torch", tmp_path / "j", "--step", 1)
    assert "not a PyTorch DCP" in error(
        1, "import", tmp_path, "--format", "dcp", tmp_path / "j", "--step", 1, "--trust-pickle"
    )
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    assert "not a readable" in error(
        1, "import", tmp_path / "junk.pt", "--format", "torch", tmp_path / "j", "--step", 1
    )
    torch.save({"w": torch.ones(2), "obj": torch.nn.Identity()}, tmp_path / "pickled.pt")
    msg = error(1, "import", tmp_path / "pickled.pt", "--format", "torch", tmp_path / "j", "--step", 1)
    assert "never unpickles" in msg
    dcp_save({"model": {"w": torch.ones(2)}, "obj": {"x": torch.nn.Identity()}}, tmp_path / "dcp_obj")
    assert "'obj.x' is not plain data" in error(
        1, "import", tmp_path / "dcp_obj", "--format", "dcp", tmp_path / "j", "--step", 1, "--trust-pickle"
    )
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert "already committed" in error(1, "import", tmp_path / "w.pt", "--format", "torch", root, "--step", 7)
    (tmp_path / "taken").write_text("x")
    assert "exists" in error(1, "export", root, "--format", "torch", tmp_path / "taken")
    assert "no state entry 'nope'" in error(1, "export", root, "--format", "torch", tmp_path / "o.pt", "--as", "nope")
    assert "--max-shard-size" in error(
        2, "export", root, "--format", "torch", tmp_path / "o.pt", "--max-shard-size", "1GB"
    )
    assert "invalid size" in error(
        2, "export", root, "--format", "safetensors", tmp_path / "o", "--max-shard-size", "x"
    )
    assert "--as" in error(2, "export", root, "--format", "dcp", tmp_path / "o", "--as", "model")
    assert not (tmp_path / "o.pt").exists() and not list(tmp_path.glob(".*partial*"))


def test_size_parsing():
    from ckptd.cli.export import parse_size

    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096
    for bad in ("", "GB", "-1GB", "5XB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ----------------------------------------------------------------------------------- memory

N_TENSORS, ROWS, COLS = 40, 2048, 1024  # 40 x 8 MiB float32 = 320 MiB

CHILD = r"""
import json, sys
import torch, torch.distributed.checkpoint, safetensors.torch  # noqa: F401 (the baseline holds them)
import ckptd.interop.common, ckptd.interop.dcp, ckptd.interop.safetensors, ckptd.interop.torchfile  # noqa
from ckptd.cli.main import main

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

out = {}
for name, argv in json.loads(sys.argv[1]):
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    rc = main(argv)
    out[name] = {"rc": rc, "peak_over_base": status("VmHWM") - base}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_import_and_export_stream(tmp_path):
    """Peak RSS over the child's baseline stays far below the checkpoint's 320 MiB for every
    import and export: they hold about one tensor (plus bounded write-behind), not all."""
    size = N_TENSORS * ROWS * COLS * 4
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(ROWS, COLS, generator=g) for i in range(N_TENSORS)}
    torch.save(sd, tmp_path / "big.pt")
    safetensors_torch.save_file(sd, tmp_path / "big.safetensors")
    dcp_save({"model": sd}, tmp_path / "big_dcp")
    del sd
    root = str(tmp_path / "job")
    ops = [
        ("import torch", ["import", str(tmp_path / "big.pt"), "--format", "torch", root, "--step", "1"]),
        (
            "import safetensors",
            ["import", str(tmp_path / "big.safetensors"), "--format", "safetensors", root, "--step", "2"],
        ),
        ("import dcp", ["import", str(tmp_path / "big_dcp"), "--format", "dcp", root, "--step", "3", "--trust-pickle"]),
        ("export torch", ["export", root, "--step", "3", "--format", "torch", str(tmp_path / "out.pt")]),
        (
            "export safetensors",
            [
                "export",
                root,
                "--step",
                "3",
                "--format",
                "safetensors",
                str(tmp_path / "st"),
                "--max-shard-size",
                "100MB",
            ],
        ),
        ("export dcp", ["export", root, "--step", "3", "--format", "dcp", str(tmp_path / "dcp_out")]),
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(ops)], capture_output=True, text=True, env=env, timeout=800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {k: f"{v['peak_over_base'] / 2**20:.0f} MiB" for k, v in res.items()}
    for name, r in res.items():
        assert r["rc"] == 0, (name, proc.stderr[-3000:])
        assert r["peak_over_base"] < size / 3, f"{name} is not streaming: peak over baseline {report}"
    # and the data went through intact
    got = safetensors_torch.load_file(tmp_path / "st" / "model-00001-of-00004.safetensors")
    assert torch.equal(got["layers.0.weight"], torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)))
