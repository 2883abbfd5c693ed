"""Issue 27 item 9: names, keys and reasons planted in a job root (or a job root's own name,
handed to the daemon) reach a terminal or a log only escaped: a newline cannot forge a line, an
escape sequence (``ESC [2J`` clears the screen) is never written raw. The real CLI in a
subprocess and a real daemon."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.security.conftest import cli
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.timeout(180)]

EVIL = "x\x1b[2J\nckptd: forged line\u202e"
FORGED = "ckptd: forged line"


def _clean(text: str) -> None:
    """No raw control character but the newlines that end lines, and no forged line."""
    assert "\x1b" not in text and "\u202e" not in text and "\r" not in text, repr(text)
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text
    assert "\\x1b[2J\\nckptd: forged line\\u202e" in text, text  # shown, escaped


def test_ls_escapes_ignored_names(tmp_path):
    root = tmp_path / "job"
    with Checkpointer(str(root)) as ck:
        ck.save(1, {"w": torch.ones(2)}).result()
    (root / f"step_{EVIL}").mkdir()
    out = cli("ls", root)
    assert out.returncode == 0, out.stderr
    _clean(out.stderr)


def test_show_escapes_tensor_keys(tmp_path):
    root = tmp_path / "job"
    with Checkpointer(str(root)) as ck:
        ck.save(1, {EVIL: torch.ones(2), "ok": torch.zeros(3)}).result()
    out = cli("show", root)
    assert out.returncode == 0, out.stderr
    _clean(out.stdout)
    js = cli("show", root, "--json")  # JSON output is escaped by JSON itself
    assert "\x1b" not in js.stdout and len(json.loads(js.stdout)["tensors"]) == 2


def test_quarantine_list_escapes_reasons_and_folder_names(tmp_path):
    root = tmp_path / "job"
    with Checkpointer(str(root)) as ck:
        ck.save(1, {"w": torch.ones(2)}).result()
    out = cli("quarantine", root, "--step", "1", "--reason", EVIL)
    assert out.returncode == 0, out.stderr
    out = cli("quarantine", root, "--list")
    assert out.returncode == 0, out.stderr
    _clean(out.stdout)
    (root / "_quarantine" / f"step_0000000001.{EVIL}").mkdir()  # a planted record folder
    out = cli("quarantine", root, "--list")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\\x1b[2J\\nckptd: forged line\\u202e") == 2, out.stdout
    _clean(out.stdout)


def test_daemon_log_escapes_a_job_root_name(tmp_path):
    """A trainer hands off a snapshot for a job root whose name carries a newline and a fake log
    line: the daemon's log keeps it on the one line of the message, escaped."""
    from tests.server.test_api import _job, _stage_manifest

    served = tmp_path / "jobs"
    root = f"{served}/run{EVIL}"
    with Daemon([str(served)], tmp_path / "staging", tmp_path / "daemon.log") as d:
        with d.client() as c:
            r = c.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 64, "client": "t"})
            assert r.status_code == 200, r.text
            lease = r.json()
            np.arange(4, dtype=np.float32).tofile(os.path.join(lease["dir"], "w.bin"))
            _stage_manifest(lease["dir"])
            job = _job(lease, root, job="ef" * 16)
            assert c.post("/v1/jobs", json=job).status_code == 200
            wait_for(lambda: c.get(f"/v1/jobs/{'ef' * 16}").json()["state"] == "committed", "commit", 60)
        logs = d.logs()
    assert "accepted job" in logs
    _clean(logs)
