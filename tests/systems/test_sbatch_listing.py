"""``deploy/slurm/elastic.sbatch``'s decisions, run as shipped by bash, in seconds and without Slurm
(issue 39, item 3). ``tests/systems/test_slurm.py`` runs the recipe under a real slurmctld
(minutes); here the commands it calls are stand-ins on ``PATH`` that record their arguments:
``srun`` (the ranks: exits with the status the case gives), ``scontrol`` (hostnames, requeue),
``scancel``, ``sleep`` (the retries' waits, recorded, not slept) and, except where the real CLI is
used, ``ckptd`` (each call answers the next of the case's listings).

``ckptd ls ROOT --json`` exits 0 with ``[]`` for a root that holds nothing (or does not exist
yet) and 1 when the root cannot be listed (storage down, wrong credentials): the recipe must
tell the two apart, retry a failed listing, never start the ranks on a root it could not list,
and requeue (not fail) a job that stopped early when it cannot tell whether steps were committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import load
from tests.distributed import launch

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "elastic.sbatch"

pytestmark = [pytest.mark.timeout(300)]

FAKES = {
    # each call answers the next line of $FAKE_DIR/ls ("RC JSON"); reshard and the rest succeed
    "ckptd": """#!/bin/bash
echo "ckptd $*" >>"$FAKE_DIR/calls"
if [[ $1 == ls ]]; then
    n=$(($(cat "$FAKE_DIR/ls.n" 2>/dev/null || echo 0) + 1)); echo $n >"$FAKE_DIR/ls.n"
    line=$(sed -n "${n}p" "$FAKE_DIR/ls")
    rc=${line%% *}; out=${line#* }
    if [[ $rc != 0 ]]; then echo "ckptd: error: s3://b/run: list failed: HTTP 500" >&2; exit "$rc"; fi
    echo "$out"
fi
""",
    "srun": '#!/bin/bash\necho "srun $*" >>"$FAKE_DIR/calls"\nexit "${FAKE_SRUN_RC:-0}"\n',
    "scontrol": """#!/bin/bash
echo "scontrol $*" >>"$FAKE_DIR/calls"
if [[ $1 == show ]]; then echo node1; fi
""",
    "scancel": '#!/bin/bash\necho "scancel $*" >>"$FAKE_DIR/calls"\n',
    "sleep": '#!/bin/bash\necho "sleep $*" >>"$FAKE_DIR/calls"\n',
}

FAILED = "1 -"


def _committed(*steps: int) -> str:
    return "0 " + json.dumps([{"step": s, "committed": True} for s in steps] + [{"step": 99, "committed": False}])


def _run(tmp_path: Path, listings: list[str], srun_rc: int = 0, real_ckptd: bool = False, **env: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, text in FAKES.items():
        if name == "ckptd" and real_ckptd:
            text = f'#!/bin/bash\necho "ckptd $*" >>"$FAKE_DIR/calls"\nexec {sys.executable} -m ckptd.cli.main "$@"\n'
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    (tmp_path / "ls").write_text("".join(line + "\n" for line in listings))
    run_env = {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "FAKE_DIR": str(tmp_path),
        "FAKE_SRUN_RC": str(srun_rc),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "node1",
        "CKPT_ROOT": "s3://b/run",
        "LIST_TRIES": "3",
        **env,
    }
    out = subprocess.run(
        ["bash", str(SBATCH)], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=load.scaled(120)
    )
    calls_file = tmp_path / "calls"
    calls = calls_file.read_text().splitlines() if calls_file.exists() else []
    return out, calls


def test_a_root_that_cannot_be_listed_is_retried_then_fails_without_starting_the_ranks(tmp_path):
    out, calls = _run(tmp_path, [FAILED] * 3)
    assert out.returncode == 1, out.stderr
    assert [c for c in calls if c.startswith("ckptd")] == ["ckptd ls s3://b/run --json"] * 3
    assert [c for c in calls if c.startswith("sleep")] == ["sleep 5", "sleep 10"]  # then it gives up
    assert not any(c.startswith(("srun", "scontrol requeue")) for c in calls), calls
    assert "cannot list s3://b/run (tried 3 times)" in out.stderr
    assert "not starting the ranks: s3://b/run could not be listed" in out.stderr


def test_an_empty_root_starts_from_scratch_and_a_failed_listing_is_not_taken_for_one(tmp_path):
    """One failed listing, then ``[]``: nothing committed, so no reshard; the ranks start."""
    out, calls = _run(tmp_path, [FAILED, "0 []", _committed(3)])
    assert out.returncode == 0, out.stderr
    assert "listing s3://b/run failed (try 1/3): retrying in 5 s" in out.stderr
    assert not any(c.startswith("ckptd reshard") for c in calls), calls
    assert any(c.startswith("srun") for c in calls)
    assert "training ended (latest committed step 3)" in out.stdout


def test_a_committed_step_is_resharded_to_the_new_size_before_the_ranks_start(tmp_path):
    out, calls = _run(tmp_path, [_committed(4, 5), _committed(5, 8)])
    assert out.returncode == 0, out.stderr
    assert calls.index("ckptd reshard s3://b/run --to 2") < next(i for i, c in enumerate(calls) if c.startswith("srun"))


def test_ranks_stopped_early_and_the_root_unlistable_after_requeue_instead_of_failing(tmp_path):
    """The ranks stopped early (status 1: preempted, or a crash after committing steps), and the
    root cannot be listed afterwards: whether steps were committed is unknown, so the job is
    requeued (the next allocation resumes or fails listing with the reason), not failed."""
    out, calls = _run(tmp_path, [_committed(5)] + [FAILED] * 3, srun_rc=1)
    assert out.returncode == 0, out.stderr
    assert "scontrol requeue 42" in calls
    assert "stopped at committed step unknown (started from 5): requeueing job 42" in out.stdout


def test_ranks_stopped_early_after_committing_a_newer_step_are_requeued(tmp_path):
    out, calls = _run(tmp_path, [_committed(5), _committed(5, 7)], srun_rc=1)
    assert out.returncode == 0 and "scontrol requeue 42" in calls, (out.stdout, calls)


def test_ranks_that_failed_and_committed_nothing_new_fail_the_job(tmp_path):
    out, calls = _run(tmp_path, [_committed(5), _committed(5)], srun_rc=1)
    assert out.returncode == 1 and "scontrol requeue 42" not in calls, (out.stdout, calls)
    assert "committed nothing new (latest step 5)" in out.stdout


@pytest.mark.s3
def test_with_the_real_cli_an_unreachable_store_is_a_failed_listing_not_an_empty_root(tmp_path, s3_bucket):
    """The real ``ckptd ls``: an S3 endpoint nobody listens on exits 1 (the recipe retries and
    refuses to start); a real bucket with nothing in it is ``[]`` (the recipe starts from 0)."""
    dead = f"http://127.0.0.1:{launch.free_port()}"
    fast = {"CKPTD_S3_MAX_ATTEMPTS": "1", "CKPTD_S3_RETRIES": "0"}
    out, calls = _run(tmp_path / "a", [], real_ckptd=True, CKPT_ROOT=s3_bucket, AWS_ENDPOINT_URL=dead, **fast)
    assert out.returncode == 1 and f"cannot list {s3_bucket} (tried 3 times)" in out.stderr, out.stderr
    assert not any(c.startswith("srun") for c in calls), calls
    out, calls = _run(tmp_path / "b", [], real_ckptd=True, CKPT_ROOT=s3_bucket, **fast)
    assert out.returncode == 0 and "training ended (latest committed step -1)" in out.stdout, out.stderr
    assert not any(c.startswith("ckptd reshard") for c in calls) and any(c.startswith("srun") for c in calls)
