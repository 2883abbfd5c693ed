"""Megatron-Core for real: its own ``dist_checkpointing.save`` (``torch_dist`` backend) at 2
ranks (``tests/systems/megatron_ckpt.py``, which names the two CUDA calls it stands in for on a
CPU-only machine), then ``ckptd import --format dcp --trust-pickle`` and a restore at 3 ranks
into an FSDP2-sharded layer (uneven shards), bit for bit. Skipped without megatron-core."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import load

REPO = Path(__file__).resolve().parents[2]

# above the sum of the three runs' own bounds (3 x 400 s), times load.SCALE like them
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = load.run(args, 400, cwd=REPO, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return p


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return _run([*launch, "tests/systems/megatron_ckpt.py", *args])


def test_megatron_torch_dist_save_imports_and_restores_at_3_ranks_bitwise(tmp_path):
    pytest.importorskip("megatron.core.dist_checkpointing")
    src = tmp_path / "megatron" / "iter_0000010"
    _torchrun(2, "save", str(src))
    assert (src / "metadata.json").read_text().find('"torch_dist"') > 0 and (src / ".metadata").is_file()
    root = tmp_path / "job"
    p = _run(
        [sys.executable, "-m", "ckptd.cli.main", "import", str(src), "--format", "dcp", "--trust-pickle"]
        + [str(root), "--step", "10"]
    )
    assert "state: layer (dict)" in p.stdout, p.stdout
    p = _torchrun(3, "restore", str(root), f"{src}.ref.pt")
    # the ranks share torchrun's stdout, so their lines may interleave: find each one's report
    assert sorted(re.findall(r"RESTORED OK rank (\d) of 3", p.stdout)) == ["0", "1", "2"], p.stdout
