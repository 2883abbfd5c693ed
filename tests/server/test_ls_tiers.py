"""``ckptd ls --daemon URL`` and the status page with real daemons on loopback: which steps live
in which memory tier and where (the node's hot copy, its peer's replica), what is left when a
node dies, and a step the tiers hold that the job root does not list is ``memory-only``, never
committed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.distributed import launch
from tests.server.daemon import ROOT, wait_for
from tests.server.daemon import node as _daemon
from tests.server.test_tiers import TOKEN, _run, _tiers, _url

pytestmark = pytest.mark.timeout(600)


def _ls(root: str, daemon: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTD_TOKEN": TOKEN}
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", "ls", root, "--daemon", daemon, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ls_shows_steps_per_tier(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    job = tmp_path / "job"
    root = f"file://{job}"
    pa, pc = launch.free_port(), launch.free_port()
    urls = [_url(pa), _url(pc)]
    a = _daemon(tmp_path, "a", root, pa, urls)
    c = _daemon(tmp_path, "c", root, pc, urls)
    try:
        _run(2, "save_steps", tmp_path / "s", daemons=[a.url], root=root, steps=[1, 2])
        wait_for(lambda: [r["step"] for r in _tiers(c)["replicas"]] == [2], "the replica on c", 120, (), c.logs)

        r = _ls(root, c.url, "--json")
        assert r.returncode == 0, r.stderr
        rows = {d["step"]: d for d in json.loads(r.stdout)}
        assert sorted(rows) == [1, 2]
        assert rows[1]["tiers"] == [] and rows[1]["committed"] and not rows[1]["memory_only"]
        where = sorted(t["where"] for t in rows[2]["tiers"])
        assert where == [f"hot@{a.url}", f"replica@{c.url}"], rows[2]
        replica = next(t for t in rows[2]["tiers"] if t["kind"] == "replica")
        assert replica["source"] == a.url and replica["ranks"] == [0, 1]

        # The status page of each node shows the same: a's hot copy (replicated to c), c's replica.
        code, body = a.get("/v1/page", TOKEN)
        assert code == 200, body
        html = body["html"]
        assert '<section id="tiers">' in html and 'class="tier tier-hot" data-step="2"' in html, html
        assert f"{c.url}: complete" in html
        code, body = c.get("/v1/page", TOKEN)
        assert 'class="tier tier-replica" data-step="2"' in body["html"] and f"from {a.url}" in body["html"]
        code, body = c.get("/v1/overview", TOKEN)
        assert [r["step"] for r in body["tiers"]["replicas"]] == [2]

        table = _ls(root, a.url)
        assert table.returncode == 0, table.stderr
        assert "TIERS" in table.stdout and f"hot@{a.url}" in table.stdout

        # Node a dies: the listing says what is left (c's replica) and which daemon did not answer.
        a.kill()
        r = _ls(root, c.url, "--json")
        assert r.returncode == 0, r.stderr
        rows = {d["step"]: d for d in json.loads(r.stdout)}
        assert [t["where"] for t in rows[2]["tiers"]] == [f"replica@{c.url}"]
        assert f"memory tier not listed: {a.url}" in r.stderr
        # Asking the dead daemon itself lists nothing of what was asked: one error, exit 2.
        r = _ls(root, a.url)
        assert r.returncode == 2 and f"cannot list the memory tiers: {a.url}" in r.stderr, (r.returncode, r.stderr)
        assert r.stdout == ""

        # A step the tiers hold and the job root does not list: memory-only, never committed.
        shutil.rmtree(job / "step_0000000002")
        r = _ls(root, c.url)
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["2"])
        assert "memory-only" in line and "committed" not in line and f"replica@{c.url}" in line
    finally:
        for d in (a, c):
            d.kill()
