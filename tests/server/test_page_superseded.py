"""The status page tells a superseded attempt from a failure (issue 28, item 12), and keeps the
end of a long reason (where the fix is), labels each step of the chart once, and counts queued
and uploading jobs as the rows do.

The superseded attempt is real: a trainer hands step 1 off to a daemon whose uploads are slowed
and dies; the same job, restarted in this process, saves step 1 again and commits it first."""

from __future__ import annotations

import time

import pytest
import torch

from ckptd.server.page import render
from tests.server import daemon as dm
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_superseded_attempt_is_no_failure(tmp_path):
    root = str(tmp_path / "job")
    env = {"SLURM_JOB_ID": "4242"}  # the job's writer id, the same after its restart: slurm-4242
    with Daemon([root], tmp_path / "staging", tmp_path / "d.log", upload_delay_s=3) as d:
        dm.kill_all(dm.saves_returned([d], root, tmp_path, extra_env=env))  # handed off, then killed
        # the job restarts (here, one rank in this process) and saves step 1 again
        with Checkpointer(root, job_id="slurm-4242") as ck:
            ck.save(1, {"w": torch.randn(4, 4)}).result()

        def jobs() -> list[dict]:
            status, body = d.get("/v1/jobs")
            assert status == 200, body
            return body if isinstance(body, list) else body["jobs"]

        wait_for(lambda: jobs() and jobs()[0]["state"] in ("failed", "committed"), "the old attempt to end", 120)
        (old,) = jobs()
        assert old["state"] == "failed", old  # its attempt lost the step to the restarted one
        status, ov = d.get("/v1/overview")
        assert status == 200, ov
        assert ov["failures"] == [], [f.get("error") for f in ov["failures"]]
        (sup,) = ov["superseded"]
        assert sup["step"] == 1 and sup["finished_at"] >= sup["accepted_at"], sup
        status, body = d.get("/v1/page")
        html = body["html"]
        assert 'class="superseded"' in html and 'class="failure"' not in html, html
        assert "Superseded attempts" in html


def _data(**over) -> dict:
    base = {
        "time": time.time(),
        "roots": [],
        "staging": {"budget": 100, "staged_bytes": 10, "leases": 1, "queue_depth": 2, "awaiting_commit": 0},
        "active": [],
        "failures": [],
        "superseded": [],
        "saves": [],
        "stalled": [],
        "more_roots": 0,
    }
    return base | over


def _job(state: str, **over) -> dict:
    j = {
        "root": "/r",
        "step": 7,
        "rank": 0,
        "world_size": 2,
        "attempt": "a",
        "state": state,
        "bytes_total": 100,
        "bytes_done": 50,
        "rate": None,
        "eta_s": None,
        "retries": 0,
        "accepted_at": 1.7e9,
        "finished_at": 1.7e9 + 60,
        "waiting_s": 5.0 if state == "uploaded" else None,
        "error": None,
    }
    return j | over


def test_a_long_reason_keeps_its_end():
    fix = "run ckptd fence /r --job old-job to retire its claims"
    reason = "step 7 is being written by job 'old-job' " + "x" * 2000 + " " + fix
    html = render(_data(failures=[_job("failed", error=reason)]))
    assert fix in html and "\u2026" in html


def test_the_chart_labels_each_step_once():
    saves = [{"root": r, "step": 7, "blocked_s": 0.1, "commit_s": 1.0, "bytes": 10} for r in ("/a", "/b", "/c")] + [
        {"root": "/a", "step": 8, "blocked_s": 0.1, "commit_s": 1.0, "bytes": 10}
    ]
    html = render(_data(saves=saves))
    labels = [t.split(">", 1)[1] for t in html.split("<text ")[1:] if 'text-anchor="middle"' in t.split(">", 1)[0]]
    assert [x.split("<", 1)[0] for x in labels] == ["7", "8"], labels


def test_the_staging_line_counts_what_the_rows_show():
    html = render(_data(active=[_job("uploading"), _job("uploading", rank=1), _job("uploaded")]))
    staging = html.split('<section id="inflight">', 1)[0]
    assert "0 queued, 2 uploading, 1 waiting for other ranks" in staging, staging
