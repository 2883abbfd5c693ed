"""One source of verdicts (issue 28 item 9): the status page of a real ``ckptd serve`` shows what
``ckptd verify --all`` recorded (it said "newest good step: 3" after the CLI found 3 bad), and
drops its verdict once the step is quarantined and saved again (it kept its own stale one)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.faults.common import chunk_files, cli, flip_byte, make_state
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)


def test_the_page_shows_the_recorded_verdicts(tmp_path):
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, make_state(seed=step)).result()
    flip_byte(chunk_files(root, 3)[0])
    assert cli("verify", root, "--all").returncode == 1

    with Daemon([root], tmp_path / "staging", tmp_path / "d.log") as d:

        def overview() -> dict:
            status, body = d.get("/v1/overview")
            assert status == 200, body
            (r,) = [r for r in body["roots"] if r["root"] == root]
            return r

        def states(r: dict) -> dict[int, str]:
            return {c["step"]: c["state"] for c in r["checkpoints"]}

        r = overview()
        assert r["newest_good_step"] == 2
        assert states(r) == {3: "corrupt", 2: "verified", 1: "verified"}

        # the page's own verify records its verdict where the CLI finds it
        req = urllib.request.Request(
            f"{d.url}/v1/page/verify?root={root}&step=2",
            method="POST",
            headers={"X-Ckptd-Page": "1", "Authorization": f"Bearer {d.token}"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            doc = json.loads(resp.read())
        assert doc["ok"] is True and doc["recorded"] is True
        rows = {x["step"]: x["verified"] for x in json.loads(cli("ls", root, "--json").stdout)}
        assert rows == {1: "ok", 2: "ok", 3: "bad"}

        # quarantined and saved again: the old verdict goes with the old bytes
        assert cli("quarantine", root, "--step", "3", "--reason", "crc32c").returncode == 0
        with Checkpointer(root) as ck:
            assert ck.restore(make_state(seed=9)) == 2
            ck.save(3, make_state(seed=33)).result()
        wait_for(lambda: overview()["newest_good_step"] == 3, "the page to drop the stale verdict", 60, logs=d.logs)
        assert states(overview())[3] == "committed"
