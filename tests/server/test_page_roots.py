"""The status page after a node failure (issue 28, items 10 and 11), with real daemons.

A fresh ``ckptd serve --root BASE`` lists the job roots already in storage below BASE (it used
to show BASE with "0 checkpoints" until a trainer handed it a save), through ``/v1/job-roots``
(paged) and on the page. A step whose other rank's node died is flagged as stalled past
``CKPTD_STALL_AFTER_S``, with the age of the wait and the rank that wrote no done record."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch
from tests.server import daemon as dm
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _save(root: str, steps: list[int]) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"w": torch.randn(8, 8)}).result()


def test_a_fresh_daemon_lists_the_job_roots_below_its_root(tmp_path):
    base = tmp_path / "base"
    run42, run7 = str(base / "run-42"), str(base / "team" / "run-7")
    _save(run42, [1, 2])
    _save(run7, [5])
    (base / "empty" / "deeper").mkdir(parents=True)
    (base / "_trash" / "step_0000000001").mkdir(parents=True)  # not a job root: "_" folders are skipped
    with Daemon([str(base)], tmp_path / "staging", tmp_path / "d.log") as d:
        status, body = d.get("/v1/job-roots")
        assert status == 200, body
        assert body["job_roots"] == [run42, run7] and body["count"] == 2 and not body["truncated"], body
        status, page2 = d.get("/v1/job-roots?limit=1&offset=1")
        assert status == 200 and page2["job_roots"] == [run7] and page2["count"] == 2, page2
        status, ov = d.get("/v1/overview")
        assert status == 200, ov
        counts = {r["root"]: r["count"] for r in ov["roots"]}
        assert counts == {run42: 2, run7: 1}, counts  # BASE itself is no job root here
        status, body = d.get("/v1/page")
        html = body["html"]
        assert status == 200 and f'data-root="{run42}"' in html and f'data-root="{run7}"' in html


def test_a_dead_nodes_step_is_flagged_stalled_with_its_missing_rank(tmp_path):
    root = str(tmp_path / "job")
    # node A serves rank 0 and flags a wait over 1 s; node B (rank 1) uploads slowly, then dies
    a = Daemon([root], tmp_path / "sa", tmp_path / "a.log", CKPTD_STALL_AFTER_S="1").start()
    b = Daemon([root], tmp_path / "sb", tmp_path / "b.log", upload_delay_s=120).start()
    procs = []
    try:
        logs = lambda: launch.logs(tmp_path, "save_and_hang", 2) + a.logs() + b.logs()  # noqa: E731
        procs = dm.saves_returned([a, b], root, tmp_path, 2)
        dm.kill_all(procs)
        b.kill()  # the node of rank 1 is gone

        def stalled() -> list:
            status, ov = a.get("/v1/overview")
            assert status == 200, ov
            return ov.get("stalled", [])

        wait_for(lambda: stalled() != [], "the step to be flagged stalled", 120, logs=logs)
        (s,) = stalled()
        assert (s["step"], s["missing_ranks"], s["world_size"]) == (1, [1], 2), s
        assert s["waiting_s"] >= 1
        status, body = a.get("/v1/page")
        assert status == 200, body
        html = body["html"]
        assert "stalled:" in html and "no done record from rank 1" in html, html
        assert "waiting for other ranks for " in html
    finally:
        dm.kill_all(procs)
        b.kill()
        a.stop()
