"""What the CLI prints (issue 28, item 13), through the real ``ckptd`` command: ``verify --all``
names each bad step once; ``gc --dry-run`` shows the files and bytes a real run removes; ``ls``
shows a partial step's size as written of expected; ``diff`` reports ulps only between values of
one sign, and a relative error for values across zero."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.distributed import launch
from trainer_hooks import Checkpointer


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True, cwd=launch.ROOT, timeout=300
    )


def _save(root: Path, steps: list[int], state: dict | None = None) -> None:
    state = state or {"a": torch.randn(128, 128), "b": torch.randn(64, 256)}
    with Checkpointer(str(root)) as ck:
        for s in steps:
            ck.save(s, state).result()


def test_verify_all_names_each_bad_step_once(tmp_path):
    root = tmp_path / "job"
    _save(root, [1, 2])
    shard = next(p for p in sorted((root / "step_0000000002" / "arrays").rglob("*")) if p.is_file() and "/c/" in str(p))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = ckptd("verify", str(root), "--all")
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [ln for ln in r.stdout.splitlines() if ": BAD: " in ln]
    assert len(bad) == 1 and "step_0000000002" in bad[0], r.stdout
    reason = bad[0].split(": BAD: ", 1)[1]
    assert (r.stdout + r.stderr).count(reason) == 1, r.stdout + r.stderr
    assert "1 of 2 steps bad: 2" in r.stderr, r.stderr


def test_gc_dry_run_shows_what_a_real_run_removes(tmp_path):
    root = tmp_path / "job"
    _save(root, [1, 2, 3])
    dry = ckptd("gc", str(root), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    real = ckptd("gc", str(root), "--keep-last", "1")
    assert real.returncode == 0, real.stderr
    pat = re.compile(r"(?:would delete|deleted) (step_\d+) \((\d+) files, ([^)]+)\)")
    got_dry, got_real = pat.findall(dry.stdout), pat.findall(real.stdout)
    assert [s for s, _, _ in got_dry] == ["step_0000000001", "step_0000000002"], dry.stdout
    assert got_dry == got_real, (dry.stdout, real.stdout)
    assert int(got_dry[0][1]) > 1
    assert "would delete 2 checkpoints:" in dry.stdout, dry.stdout


def test_ls_shows_a_partial_step_as_written_of_expected(tmp_path):
    root = tmp_path / "job"
    _save(root, [1])
    part = root / "step_0000000002"
    shutil.copytree(root / "step_0000000001", part)
    (part / "commit.json").unlink()
    # the manifest must say step 2; the copy says 1: rewrite it the way rank 0 would
    m = json.loads((part / "manifest.json").read_text())
    m["step"] = 2
    (part / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(part / "arrays" / "a" / "c")  # one array's data never arrived
    r = ckptd("ls", str(root), "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert rows[1]["committed"] and rows[2]["committed"] is False
    assert rows[2]["expected_bytes"] > rows[2]["bytes"], rows[2]
    assert rows[2]["expected_bytes"] <= rows[1]["bytes"], (rows[1], rows[2])  # data only, no metadata
    text = ckptd("ls", str(root))
    line = next(ln for ln in text.stdout.splitlines() if ln.split()[:1] == ["2"])
    assert "partial" in line and " of " in line, text.stdout


def test_diff_ulps_stay_within_one_sign(tmp_path):
    a = np.array([1e-30, 1.0, 5.0], np.float32)
    b = a.copy()
    b[0] = -1e-30  # across zero: billions of floats apart, relative error 2
    bits = b.view(np.uint32)
    bits[1] += 3  # 3 ulps above 1.0
    _save(tmp_path / "a", [1], {"w": torch.from_numpy(a)})
    _save(tmp_path / "b", [1], {"w": torch.from_numpy(b)})
    r = ckptd("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert r.returncode == 1, r.stderr
    (w,) = [t for t in json.loads(r.stdout)["tensors"] if t["key"] == "w"]
    assert (w["different"], w["max_ulps"], w["cross_zero"]) == (2, 3, 1), w
    assert w["max_rel_diff"] == 2.0, w
    text = ckptd("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert "3 (1 across 0)" in text.stdout, text.stdout
