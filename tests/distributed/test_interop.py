"""DCP interop across world sizes, in real gloo processes with FSDP2 + AdamW.

One job of 2 ranks trains, then saves the same state with ``dcp.save`` and with ``Checkpointer``.
Then: the DCP folder goes through ``ckptd import`` and ``Checkpointer.restore`` at 3 ranks gives
back every tensor bitwise (model, AdamW state, scheduler, bf16/bool/empty extras); and the ckptd
checkpoint goes through ``ckptd export --format dcp`` and ``dcp.load`` at 2 ranks, bitwise too.
Three launches in all (each ~10 s on a small machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.cli.main import main
from tests.distributed import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_interop(world: int, scenario: str, out: Path, **args) -> list[dict]:
    """launch.run with the scenarios of interop_scenarios.py."""
    return launch.run(world, scenario, out, timeout=300, scenarios="tests.distributed.interop_scenarios", **args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("interop")
    paths = {"out": out, "dcp": out / "dcp_ws2", "root": out / "ckptd_ws2"}
    res = run_interop(2, "save_dcp_and_ckptd", out, layout="fsdp", dcp_dir=str(paths["dcp"]), root=str(paths["root"]))
    return paths, res[0]


def test_dcp_saved_at_2_imports_and_restores_at_3_bitwise(saved, capsys):
    paths, ref = saved
    out, root = paths["out"], str(paths["out"] / "imported")
    assert (
        main(["import", str(paths["dcp"]), "--format", "dcp", root, "--step", str(ref["saved_step"]), "--trust-pickle"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "model (dict)" in printed and "optim (optimizer)" in printed and "sched (dict)" in printed
    res = run_interop(3, "restore_imported", out, layout="fsdp", root=root, ref="ref_fsdp_2.pt", next_step=2)
    r0 = res[0]
    assert r0["step"] == ref["saved_step"]
    assert r0["mismatches"] == [], f"tensors differ after import + restore: {r0['mismatches']}"
    assert r0["sched_last_epoch"] == ref["saved_step"] + 1  # the scheduler came through DCP too
    assert r0["meta"] == {"seed": 0}
    assert r0["next_loss"] == pytest.approx(ref["next_loss"], rel=1e-5)  # 3 ranks reduce in another order


def test_ckptd_export_dcp_loads_with_dcp_at_2_bitwise(saved, capsys):
    paths, ref = saved
    out = paths["out"]
    exported = out / "exported_dcp"
    assert main(["export", str(paths["root"]), "--format", "dcp", str(exported)]) == 0
    capsys.readouterr()
    res = run_interop(2, "load_dcp", out, layout="fsdp", dcp_dir=str(exported), ref="ref_fsdp_2.pt", next_step=2)
    r0 = res[0]
    assert r0["mismatches"] == [], f"tensors differ after export + dcp.load: {r0['mismatches']}"
    assert r0["sched_last_epoch"] == ref["saved_step"] + 1
    assert r0["meta"] == {"seed": 0}
    # same world size and layout as the save: the next step is exactly the uninterrupted one
    assert r0["next_loss"] == ref["next_loss"]
    assert len({r["next_loss"] for r in res}) == 1
