"""What a restarting training process and the command line pay before doing anything.

``import trainer_hooks`` (after torch) and ``ckptd --help``/``ls``/``show``/``verify`` load no
heavy module until a checkpoint or a command needs it: ``ml_dtypes`` (its extension alone took
1.1-1.45 s) only for a bfloat16/float8 array read as numpy, ``torch.distributed.checkpoint``
(it imports DTensor and sympy, most of a second) only at the first save or restore of a module
or optimizer, boto3 only for an ``s3://`` root, the daemon's and zarr's stacks only in their
commands.

The cost is also bounded, as a ratio of CPU time to a bare ``python -c pass`` measured in the
same run: CPU time, because on a loaded machine wall time mostly measures the wait for a core;
the minimum of several interleaved rounds. The bound, 10, is the 0.3 s target over the 0.03 s an
idle interpreter takes to start. Figures (2 cores at load 10-14; bytecode cached): ``python -c
pass`` 0.035 s; ``import trainer_hooks`` after torch 0.026 s, ratio 0.7 (1.26 s, ratio 37, when
ml_dtypes and ``torch.distributed.checkpoint`` loaded at import); ``ckptd --help`` 0.18 s, ratio
5 (0.69 s, ratio 20, before).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_hooks import Checkpointer

REPO = Path(__file__).resolve().parents[2]

# Modules nothing on the start-up path needs (top-level package names).
HEAVY = {
    "ml_dtypes",
    "tensorstore",
    "zarr",
    "fastapi",
    "starlette",
    "uvicorn",
    "boto3",
    "botocore",
    "obstore",
    "safetensors",
    "sympy",
}
# Parts of torch that ``import torch`` does not load and ``import trainer_hooks`` must not.
TORCH_HEAVY = {
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.optim",
    "torch.distributed.fsdp",
}

# Bounds on (time) / (python -c pass): the 0.3 s target over an idle interpreter's 0.03 s.
TRAINER_HOOKS_BOUND = 10
CLI_HELP_BOUND = 10
ROUNDS = 5


def _env() -> dict[str, str]:
    """This checkout first; bytecode cached as an installed package has it (a process that
    compiles every module from source, as under ``PYTHONDONTWRITEBYTECODE``, times the compiler)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY or m in TORCH_HEAVY)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A small local root whose arrays need ml_dtypes as numpy (bfloat16, float8)."""
    path = tmp_path_factory.mktemp("root")
    state = {
        "model": torch.nn.Linear(4, 4),
        "b": torch.ones(8, dtype=torch.bfloat16),
        "f8": torch.ones(8).to(torch.float8_e4m3fn),
    }
    with Checkpointer(str(path)) as ck:
        ck.save(1, state).result()
    return str(path)


def test_import_trainer_hooks_loads_nothing_heavy():
    mods = _loaded("import torch, trainer_hooks")
    assert "trainer_hooks.checkpointer" in mods
    assert _heavy(mods) == []


@pytest.mark.parametrize("argv", [["--help"], ["ls"], ["show"], ["verify"]], ids=lambda a: a[0])
def test_the_cli_starts_without_heavy_modules(root, argv):
    args = argv + ([root] if argv != ["--help"] else [])
    code = (
        "import contextlib, io\n"
        "from ckptd.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    rc = main({args!r})\n"
        "assert rc == 0 and out.getvalue(), (rc, out.getvalue())"
    )
    mods = _loaded(code)
    assert "ckptd.cli.ls" in mods
    assert _heavy(mods) == [] and "torch" not in mods


@pytest.mark.slow
def test_ml_dtypes_loads_only_for_a_checkpoint_that_holds_its_types(tmp_path):
    code = (
        "import torch\n"
        "from trainer_hooks import Checkpointer\n"
        "state = {{'model': torch.nn.Linear(4, 4).to({dtype}), 'step': torch.tensor(3)}}\n"
        "with Checkpointer({root!r}) as ck:\n"
        "    ck.save(1, state).result()\n"
        "    assert ck.restore(state) == 1"
    )
    plain = _loaded(code.format(dtype="torch.float32", root=str(tmp_path / "f32")))
    assert "ml_dtypes" not in plain and "torch.distributed.checkpoint" in plain  # the save ran
    assert "ml_dtypes" in _loaded(code.format(dtype="torch.bfloat16", root=str(tmp_path / "bf16")))


def _cpu(cmd: list[str]) -> float:
    """The CPU time (user + system) a command takes: on a loaded machine its wall time is mostly
    the wait for a core."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, timeout=120, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _import_after_torch() -> float:
    """The CPU time of ``import trainer_hooks`` in a process that has imported torch."""
    code = "import time, torch\nt = time.process_time()\nimport trainer_hooks\nprint(time.process_time() - t)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return float(out.stdout.split()[-1])


@pytest.mark.slow
def test_start_up_cost_stays_within_its_bound():
    _import_after_torch(), _cpu([sys.executable, "-m", "ckptd.cli.main", "--help"])  # bytecode written
    bare, hooks, cli = [], [], []
    for _ in range(ROUNDS):  # interleaved, so load on the machine weighs on each alike
        bare.append(_cpu([sys.executable, "-c", "pass"]))
        hooks.append(_import_after_torch())
        cli.append(_cpu([sys.executable, "-m", "ckptd.cli.main", "--help"]))
    base = min(bare)
    figures = f"python -c pass {base:.3f} s, import trainer_hooks {min(hooks):.3f} s, ckptd --help {min(cli):.3f} s"
    assert min(hooks) / base <= TRAINER_HOOKS_BOUND, figures
    assert min(cli) / base <= CLI_HELP_BOUND, figures
