"""A dead node's daemon restarted on its old staging must not resurrect a step that was saved
again and deleted by gc meanwhile (issue 28 item 3: it resumed "job ... step 1 rank 0" and wrote
the old snapshot back into the root).

Real processes: a trainer hands step 1 off to a daemon whose uploads are slowed; trainer and
daemon are SIGKILLed mid-upload (the journal says "accepted"); the job, restarted here under the
same job id, saves steps 1 and 2; ``ckptd gc --keep-last 1`` deletes step 1; then a daemon starts
on the old staging folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.faults.common import cli
from tests.server import daemon as dm
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_recovered_job_of_a_step_deleted_since_is_discarded(tmp_path):
    root = str(tmp_path / "job")
    staging = tmp_path / "staging"
    env = {"SLURM_JOB_ID": "4343"}  # the job's writer id, the same after its restart: slurm-4343
    d = Daemon([root], staging, tmp_path / "d1.log", upload_delay_s=30).start()
    try:
        procs = dm.saves_returned([d], root, tmp_path, extra_env=env)
        try:
            wait_for(lambda: any(Path(root).glob("step_0000000001/_claims/*")), "the upload to start", 120)
        finally:
            dm.kill_all(procs)
    finally:
        d.kill()  # the node dies: no shutdown code runs, the journal stays "accepted"

    with Checkpointer(root, job_id="slurm-4343") as ck:  # the job restarted elsewhere
        ck.save(1, {"w": torch.ones(4, 4)}).result()
        ck.save(2, {"w": torch.full((4, 4), 2.0)}).result()
    out = cli("gc", root, "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    assert not (Path(root) / "step_0000000001").exists()

    with Daemon([root], staging, tmp_path / "d2.log") as d2:  # the node comes back

        def jobs() -> list[dict]:
            status, body = d2.get("/v1/jobs")
            assert status == 200, body
            return body if isinstance(body, list) else body["jobs"]

        wait_for(
            lambda: jobs() and all(j["state"] in ("committed", "failed", "discarded") for j in jobs()),
            "the journalled job to be decided",
            120,
            logs=d2.logs,
        )
        (job,) = jobs()
        assert job["state"] == "discarded" and "committed step 2 since" in job["error"], job
        assert "discarding job" in d2.logs()
    assert not (Path(root) / "step_0000000001").exists()
    rows = json.loads(cli("ls", root, "--json").stdout)
    assert [r["step"] for r in rows] == [2]
