"""What the fault tests share: a small training state, bitwise comparison, the real CLI in a
subprocess, and helpers that damage checkpoints on disk the way failing hardware does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
STEP_DIR = "step_{:010d}"


def make_state(seed: int = 0) -> dict:
    """A model (two layers), its optimizer and a dict of tensors; ``seed`` sets every value."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"emb": torch.randn(64, 8)}}


def values(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    out["extra/emb"] = state["extra"]["emb"].clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two ``values`` dicts."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].view(torch.uint8).equal(b[k].view(torch.uint8))
        for k in a
    )


def cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ckptd ARGS`` as a user runs it: a separate process, with this worktree first on the path."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=str(ROOT),
    )


def all_files(folder: str | Path) -> list[str]:
    """Every entry under ``folder`` (hidden temp files and folders included), relative."""
    folder = Path(folder)
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def chunk_files(root: str | Path, step: int) -> list[Path]:
    """The shard/chunk objects of a step on a local root, largest first."""
    arrays = Path(root) / STEP_DIR.format(step) / "arrays"
    files = [p for p in arrays.rglob("*") if p.is_file() and p.name != "zarr.json" and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (-p.stat().st_size, str(p)))


def flip_byte(path: Path) -> None:
    """Flip one byte in the middle of a file, in place (bit rot, a bad disk sector)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)
