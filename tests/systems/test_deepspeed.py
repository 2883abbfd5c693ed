"""DeepSpeed for real (``pip install deepspeed``, 0.19.8 here; it does not move torch): ZeRO-1,
ZeRO-2 and ZeRO-3 training on DeepSpeed's CPU accelerator with gloo at 2 ranks, ``save_checkpoint``,
DeepSpeed's own ``ds_to_universal``, then ``ckptd import --format deepspeed-universal`` and a
restore at another world size (1) that must give DeepSpeed's fp32 weights and Adam moments bit for
bit; ZeRO-3 is also restored at 3 ranks into FSDP2 (``tests/systems/ds_restore.py``, uneven shards).

What this found: the universal ``zero/optimizer_state.pt`` that DeepSpeed writes holds a pickled
``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and a ``ZeroStageEnum`` even in fp32 training;
the hand-built layout in tests/e2e/test_interop.py did not have them, and ckptd (which never
unpickles objects) left the optimizer out. They now unpickle as inert records
(``ckptd.interop.deepspeed.DEEPSPEED_BOOKKEEPING``), and the test checks the Adam moments too.
ZeRO-3's universal files are bare flat tensors, their shapes only in ``param_shapes`` of the
``zero_pp_rank_*_model_states.pt`` beside ``zero/``: ckptd refused them; it now reads the shapes
from there.

Runs in CI (deepspeed is in the dev extra; ~1.5 min for the three stages on 2 idle cores, ~7 min
at load average 14): DeepSpeed's CPU accelerator would JIT-compile its ``deepspeed_shm_comm`` C++
op (about 9 minutes here) when the first engine starts; ``ds_train.py`` marks that op
incompatible, as DeepSpeed does itself where it cannot build it, so the collectives go through
torch.distributed (gloo) and nothing is compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import load

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    # Above the sum of the four runs' own bounds (4 x 300 s), so that one of those fires first
    # with the run's output (pytest's own timeout reports no child output). Both times load.SCALE.
    pytest.mark.timeout(1500),
]


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Idle, each run takes ~5-20 s; ``timeout`` is times ``load.SCALE``, its failure carries the
    run's output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = load.run(args, timeout, cwd=REPO, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return p


def _param(path) -> torch.Tensor:
    """A universal file's tensor: ``{"param": t}`` (ZeRO-1/2) or the bare flat tensor (ZeRO-3)."""
    obj = torch.load(path, weights_only=True)
    return obj["param"] if isinstance(obj, dict) else obj


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checkpoint_through_ds_to_universal_imports_and_restores_bitwise(tmp_path, stage):
    _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + ["tests/systems/ds_train.py", str(tmp_path), str(stage)]
    )
    universal = tmp_path / "universal" / "step3"
    _run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tmp_path / "ck" / "step3")]
        + ["--output_folder", str(universal)]
    )
    root = tmp_path / "job"
    p = _run(
        [sys.executable, "-m", "ckptd.cli.main", "import", str(universal), "--format", "deepspeed-universal"]
        + [str(root), "--step", "3"]
    )
    assert "state: model (dict)" in p.stdout
    assert "state: model (dict), optim (optimizer)" in p.stdout, p.stdout + p.stderr

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from trainer_hooks import Checkpointer

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    with Checkpointer(str(root)) as ck:
        ck.restore({"model": model, "optim": optim})
    trained = torch.load(tmp_path / "module.pt")
    restored = dict(model.named_parameters())
    assert trained.keys() == restored.keys()
    osd = get_optimizer_state_dict(model, optim)
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["weight_decay"] == 0.01
    for name, value in trained.items():
        assert torch.equal(restored[name].detach(), value), name
        fp32 = _param(universal / "zero" / name / "fp32.pt")
        assert torch.equal(restored[name].detach(), fp32.view_as(value)), name
        for moment in ("exp_avg", "exp_avg_sq"):  # DeepSpeed's Adam moments, merged by ds_to_universal
            want = _param(universal / "zero" / name / f"{moment}.pt")
            assert torch.equal(osd["state"][name][moment], want.view_as(value)), (name, moment)
        assert float(osd["state"][name]["step"]) == 4.0, name

    if stage == 3:
        # Saved at 2 ranks, restored at 3 into FSDP2 (uneven row shards), every rank checking
        # the gathered weights and moments against DeepSpeed's universal files.
        p = _run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
            + ["tests/systems/ds_restore.py", str(root), str(universal)]
        )
        # the ranks share torchrun's stdout, so their lines may interleave: find each one's report
        assert sorted(re.findall(r"RESTORED OK rank (\d) of 3", p.stdout)) == ["0", "1", "2"], p.stdout
