"""Helpers for the attack tests: a small real checkpoint, the real ``ckptd`` CLI in a
subprocess (exit status, one stderr line, no traceback), and a second unprivileged local user.

Every test here performs its attack for real (symlinks, FIFOs, device files, another uid, the
daemon on loopback) and checks both that it is refused and that nothing outside the job root was
read, written or deleted.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_hooks import Checkpointer

REPO = Path(__file__).resolve().parents[2]
ATTACKER = "ckptd-attacker"


def small_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8), "b": torch.randn(8)}, "meta": {"epoch": seed}}


def make_root(root: Path, steps=(1, 2)) -> Path:
    """A job root with the given committed steps, saved by the real in-process Checkpointer."""
    ckpt = Checkpointer(str(root))
    try:
        for s in steps:
            ckpt.save(s, small_state(s)).result()
    finally:
        ckpt.close()
    return root


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def cli(*argv, timeout: float = 60, limit_mb: int | None = None) -> subprocess.CompletedProcess:
    """``ckptd ARGV`` as a real process; ``limit_mb`` caps its address space (RLIMIT_AS)."""
    pre = None
    if limit_mb is not None:

        def pre():
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))

    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=str(REPO),
        preexec_fn=pre,
    )


def assert_one_line_error(p: subprocess.CompletedProcess, rc=(1, 2)) -> str:
    assert p.returncode in rc, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if line.startswith("ckptd: error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="session")
def attacker() -> pwd.struct_passwd:
    """A second, unprivileged local user (created once; needs root, else the test is skipped)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second local user")
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        pass
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER], check=True)
    return pwd.getpwnam(ATTACKER)


def as_user(user: pwd.struct_passwd, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``user`` (setpriv: no root, no supplementary groups)."""
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--", *cmd],
        capture_output=True,
        text=True,
        timeout=60,
        check=check,
    )
