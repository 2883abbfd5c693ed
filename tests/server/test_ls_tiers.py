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
import torch

from tests.distributed import launch
from tests.server.daemon import ROOT, wait_for
from tests.server.daemon import node as _daemon
from tests.server.test_tiers import TOKEN, _run, _tiers, _url
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(600)
MEMSTEPS = "tests.server.memstep_scenarios"


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
        _run(2, "save_steps", tmp_path / "s", daemons=[a.socket_url], root=root, steps=[1, 2])
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


def _token(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)


def _ls_json(root: str, daemon: str) -> tuple[dict[int, dict], str]:
    r = _ls(root, daemon, "--json")
    assert r.returncode == 0, r.stderr
    return {d["step"]: d for d in json.loads(r.stdout)}, r.stderr


def test_the_page_after_a_node_loss(tmp_path, monkeypatch):
    """Node c is SIGKILLed: a's page names c as not answering (when and why), counts the pushes
    to it that failed with the last one's reason, no longer calls its copy on c complete, and
    names the step a restore takes now: the memory-only step a holds whole, not the newest
    committed one."""
    _token(tmp_path)
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    root = f"file://{tmp_path / 'job'}"
    pa, pc = launch.free_port(), launch.free_port()
    a = _daemon(tmp_path, "a", root, pa, [_url(pa), _url(pc)])
    c = _daemon(tmp_path, "c", root, pc, [_url(pa), _url(pc)])
    state = {"w": torch.randn(16, 4)}
    try:
        with Checkpointer(root, daemon=a.socket_url, persist_every=2) as ck:
            for step in (1, 2, 3):  # 1 and 3 memory-only (held by a, replicated to c), 2 committed
                ck.save(step, state).result()
        wait_for(lambda: 3 in {p["step"] for p in _tiers(c)["memory_only"]}, "c's replica of 3", 120, (), c.logs)
        (row,) = a.get("/v1/overview", TOKEN)[1]["roots"]
        assert row["newest_good_step"] == 2 and row["restore"]["step"] == 3, row
        assert "memory-only step held whole" in row["restore"]["why"]

        c.kill()
        with Checkpointer(root, daemon=a.socket_url, persist_every=2) as ck:
            ck.save(4, state).result()  # committed: its hot copy's push to c fails
            ck.save(5, state).result()  # memory-only: its push to c fails too
        wait_for(lambda: _tiers(a)["push_failures"] >= 2, "the failed pushes", 120, (), a.logs)
        code, ov = a.get("/v1/overview", TOKEN)
        assert code == 200, ov
        dead = ov["tiers"]["unreachable"]
        assert list(dead) == [c.url] and "cannot reach the ckptd daemon" in dead[c.url]["error"], dead
        assert c.url in ov["tiers"]["last_push_failure"]["error"]
        (row,) = ov["roots"]
        assert (row["newest_good_step"], row["restore"]["step"]) == (4, 5), row
        html = a.get("/v1/page", TOKEN)[1]["html"]
        failures = html[html.index('<section id="failures">') :]
        failures = failures[: failures.index("</section>")]
        assert f"peer {c.url} does not answer" in failures and "replica pushes failed" in failures, failures
        assert "none" not in failures
        assert f"{c.url}: complete" not in html and f"{c.url}: lost: the peer does not answer" in html
        assert '<span class="restore-step">5</span>' in html and '<span class="newest">4</span>' in html

        # ckptd ls --daemon: the memory-only step is whole; without a token, exit 2 naming it.
        rows, _ = _ls_json(root, a.url)
        assert rows[5]["memory_only"] and rows[5]["whole"] is True and rows[4]["whole"] is None, rows
        env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_TOKEN", "CKPTD_TOKEN_FILE")}
        r = subprocess.run(
            [sys.executable, "-m", "ckptd.cli.main", "ls", root, "--daemon", a.url],
            env={**env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "CKPTD_TOKEN_FILE" in r.stderr and r.stdout == "", (r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        for d in (a, c):
            d.kill()


def test_ls_marks_memory_only_steps_whole_or_partial(tmp_path):
    """Two ranks, each on its own node's daemon, no replicas: the memory-only step is whole only
    across both daemons; once node c is SIGKILLed, a alone holds it partial, and its page says a
    restore takes the committed step, and why."""
    _token(tmp_path)
    root = f"file://{tmp_path / 'job'}"
    pa, pc = launch.free_port(), launch.free_port()
    urls = [_url(pa), _url(pc)]
    a = _daemon(tmp_path, "a", root, pa, urls, CKPTD_REPLICAS="0")
    c = _daemon(tmp_path, "c", root, pc, urls, CKPTD_REPLICAS="0")
    try:
        out = tmp_path / "out"
        args = {"daemons": [a.socket_url, c.socket_url], "root": root, "last": 3, "persist_every": 2, "hang": False}
        procs = launch.spawn(2, "save_memory", args, out, {"CKPTD_TOKEN": TOKEN}, scenarios=MEMSTEPS)
        launch.wait(procs, out, "save_memory", timeout=600)

        rows, err = _ls_json(root, a.url)
        assert "not listed" not in err, err
        assert rows[3]["memory_only"] and rows[3]["whole"] is True, rows[3]
        assert sorted(t["where"] for t in rows[3]["tiers"]) == sorted([f"memory@{a.url}", f"memory@{c.url}"])
        table = _ls(root, a.url)
        assert table.returncode == 0 and "HELD" in table.stdout, table.stderr
        line = next(ln for ln in table.stdout.splitlines() if ln.split()[:1] == ["3"])
        assert line.split()[1:3] == ["memory-only", "-"] and " whole " in line, line

        c.kill()
        rows, err = _ls_json(root, a.url)
        assert f"memory tier not listed: {c.url}" in err
        assert rows[3]["whole"] is False and [t["where"] for t in rows[3]["tiers"]] == [f"memory@{a.url}"], rows
        line = next(ln for ln in _ls(root, a.url).stdout.splitlines() if ln.split()[:1] == ["3"])
        assert " partial " in line, line

        (row,) = a.get("/v1/overview", TOKEN)[1]["roots"]
        assert row["restore"]["step"] == 2 and not row["restore"]["memory_only"], row
        assert (
            "memory-only step 3 is not held whole here: the done record of rank 1 is not held" in row["restore"]["why"]
        )
        (step,) = [s for s in a.get("/v1/overview", TOKEN)[1]["memory_only"] if s["step"] == 3]
        assert not step["whole_here"] and "rank 1" in step["not_whole"], step
    finally:
        for d in (a, c):
            d.kill()
