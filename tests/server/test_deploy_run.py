"""The systemd recipe run for real (issue 39, item 2): ``systemd-analyze verify`` on the shipped
unit, and the daemon started by the unit's ExecStart under the unit's own sandbox
(``tests/server/unit_sandbox.py``: a private mount namespace per "node", ProtectSystem=strict,
ReadWritePaths, User=, capabilities, the shipped ``ckptd.env``).

* Two such nodes save to the env file's local root and to an S3 root (moto), and the S3 step's
  hot copy is replicated to the other node through ``--discover`` (the env file's ring settings).
  Before, the unit's ReadWritePaths had ``/dev/shm`` only: a local root was read-only to it.
* A local root outside ReadWritePaths, and one the daemon's user cannot write (the daemon run as
  ckptd-bob), refuse the start with the reason, before any trainer hands off.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ckptd import catalog
from storage_backends import open_store
from tests import load
from tests.distributed import launch
from tests.server import unit_sandbox as sandbox

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not shutil.which("unshare") or not shutil.which("setpriv"), reason="needs unshare, setpriv"),
]

TRAIN = """
import sys, torch
from trainer_hooks import Checkpointer
for root in sys.argv[1:]:
    with Checkpointer(root, daemon=True) as ck:
        ck.save(1, {"w": torch.arange(4096.0), "b": torch.ones(3)}).result(timeout=120)
print("saved", *sys.argv[1:])
"""


def _can_sandbox(tmp_path: Path) -> None:
    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", str(tmp_path)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")


def test_systemd_analyze_verify_accepts_the_shipped_unit(tmp_path):
    """``systemd-analyze verify`` wants ExecStart's binary to exist: it is made to, in a private
    mount namespace (a tmpfs on /opt), so the shipped file is checked unchanged. Unknown keys and
    malformed values are warnings on stderr with exit 0, so stderr must be empty too."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    _can_sandbox(tmp_path)
    argv0 = sandbox.unit()["Service.ExecStart"][-1].split()[0]
    assert argv0.startswith("/opt/"), argv0
    script = (
        f'mount -t tmpfs tmpfs /opt && mkdir -p "$(dirname {argv0})" && printf "#!/bin/sh\\n" > {argv0} '
        f'&& chmod 0755 {argv0} && exec systemd-analyze verify --man=no "$1"'
    )
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "verify", str(sandbox.UNIT)],
        capture_output=True,
        text=True,
        timeout=load.scaled(120),
    )
    assert out.returncode == 0 and out.stderr == "" and out.stdout == "", (out.returncode, out.stderr, out.stdout)


class Node:
    """One machine: the unit's daemon in its sandbox, reachable on loopback at ``url``."""

    def __init__(
        self, tmp: Path, name: str, token: str, peer_key: str, roots: list[str], start: dict | None = None, **env: str
    ):
        self.port, self.data_port = launch.free_port(), launch.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token, self.log = token, tmp / f"{name}.log"
        overrides = {
            # loopback for the test (the env file binds 0.0.0.0), a port each (one host here)
            "CKPTD_HOST": "127.0.0.1",
            "CKPTD_PORT": str(self.port),
            "CKPTD_TIER_DATA_PORT": str(self.data_port),
            "CKPTD_ADVERTISE": self.url,
            "CKPTD_ROOTS": json.dumps(roots),
            **env,
        }
        self.proc = sandbox.start(tmp / name, overrides, token, peer_key, self.log, **(start or {}))

    def wait_up(self) -> None:
        deadline = load.deadline(60)
        while True:
            assert self.proc.poll() is None, self.logs()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.2)

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=load.scaled(60))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _roots(s3_root: str) -> tuple[str, list[str]]:
    """The env file's roots, its S3 root swapped for this test's bucket: (the local one, all)."""
    shipped = json.loads(sandbox.env_file()["CKPTD_ROOTS"])
    local = [r for r in shipped if r.startswith("/")]
    assert len(local) == 1 and len(shipped) == 2 and any(r.startswith("s3://") for r in shipped), shipped
    return local[0], [local[0], s3_root]


@pytest.mark.s3
def test_the_unit_saves_to_a_local_and_an_s3_root_and_replicates_to_the_next_node(tmp_path, s3_server, s3_bucket):
    _can_sandbox(tmp_path)
    local, roots = _roots(s3_bucket)
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the moto server's
    token, peer_key = secrets.token_hex(24), secrets.token_hex(32)
    nodes = [Node(tmp_path, name, token, peer_key, roots, **aws) for name in ("n1", "n2")]
    try:
        for n in nodes:
            n.wait_up()
        n1, n2 = nodes
        # a trainer on node 1 (root, in node 1's namespace), through the unit's socket
        job_local, job_s3 = f"{local}/run-1", f"{s3_bucket}/run-1"
        env = {"PYTHONPATH": sandbox.CODE, "CKPTD_TOKEN_FILE": "/etc/ckptd/token", "OMP_NUM_THREADS": "1"}
        env |= aws | {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
        out = sandbox.enter(n1.proc.pid, [sys.executable, "-c", TRAIN, job_local, job_s3], env, load.scaled(240))
        assert out.returncode == 0, (out.stderr[-4000:], n1.logs())
        # committed in both roots
        ls = sandbox.enter(
            n1.proc.pid, [sys.executable, "-m", "ckptd.cli.main", "ls", job_local, "--json"], env, load.scaled(120)
        )
        assert ls.returncode == 0, ls.stderr
        assert [(r["step"], r["committed"]) for r in json.loads(ls.stdout)] == [(1, True)], ls.stdout
        store = open_store(job_s3)
        try:
            assert catalog.committed_steps(store) == [1]
        finally:
            store.close()
        # the S3 step's hot copy on node 1, its replica on node 2 (found through _daemons/)
        deadline = load.deadline(60)
        while True:
            tiers = n2.get("/v1/tiers")
            held = [c for c in tiers.get("replicas", []) if c.get("step") == 1 and c.get("complete")]
            if held:
                break
            assert time.monotonic() < deadline, (tiers, n1.logs(), n2.logs())
            time.sleep(0.5)
        assert held[0]["root"].rstrip("/") in (job_s3.rstrip("/"), s3_bucket.rstrip("/")), held
        hot = [c for c in n1.get("/v1/tiers")["hot"] if c.get("step") == 1]
        assert hot, n1.get("/v1/tiers")
    finally:
        for n in nodes:
            n.stop()
    for n in nodes:
        assert "Read-only file system" not in n.logs(), n.logs()


def _refused(node: Node, root: str, why: str) -> None:
    try:
        rc = node.proc.wait(timeout=load.scaled(120))
    finally:
        node.stop()
    text = node.log.read_text(errors="replace")
    errors = [ln for ln in text.splitlines() if ln.startswith("ckptd: error:")]
    assert rc == 2 and len(errors) == 1, (rc, text[-4000:])
    assert f"refusing to serve {root}: this daemon cannot write there" in errors[0] and why in errors[0], errors
    assert "Application startup complete" not in text and "Traceback" not in text, text[-4000:]


def test_a_local_root_outside_readwritepaths_refuses_the_start(tmp_path):
    """/opt/jobs: the daemon's own folder, but on the read-only file system ProtectSystem=strict
    leaves outside ReadWritePaths (its CAP_DAC_OVERRIDE does not help)."""
    _can_sandbox(tmp_path)
    prep = "install -d -m 0750 -o ckptd -g ckptd /opt/jobs"
    node = Node(tmp_path, "n1", secrets.token_hex(24), secrets.token_hex(32), ["/opt/jobs"], start={"prep": prep})
    _refused(node, "/opt/jobs", "Read-only file system")


def test_a_root_the_daemons_user_cannot_write_refuses_the_start(tmp_path):
    """The daemon run as ckptd-bob (no capabilities) on a writable file system, its root a folder
    of root's, mode 0755: permission denied, and it says so."""
    _can_sandbox(tmp_path)
    root = "/var/lib/ckptd/jobs"
    prep = f"install -d -m 0755 -o root -g root {root} && chgrp ckptd-bob /etc/ckptd/token"
    start = {"prep": prep, "run_as": "ckptd-bob"}
    node = Node(tmp_path, "n1", secrets.token_hex(24), secrets.token_hex(32), [root], start=start)
    _refused(node, root, "Permission denied")
