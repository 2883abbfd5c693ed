"""The daemon's status page, in a real browser (Debian's chromium, driven by playwright) against
real ``ckptd serve`` processes: a real trainer commits steps through the daemon and leaves one
save in flight (the daemon's uploads slowed by ``Daemon(upload_delay_s=...)``); a real hand-off
under a job root named like an XSS payload fails; the page must show it all, escaped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.daemon import ROOT, Daemon, wait_for

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("CKPTD_TEST_CHROMIUM", "/usr/bin/chromium")
SCREENSHOT = ROOT / "docs" / "status-page.png"
# A job root name that breaks out of text and attributes if anything is not escaped.
EVIL = "x\"'><img src=x onerror=\"document.title='pwned'\">"
TOKEN = "page-token-0123"


@pytest.fixture(scope="module")
def browser():
    """A headless chromium, or a skip naming exactly why it cannot start."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as e:
        pytest.skip(f"playwright is not installed ({e}); .ci/run installs it")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        except Error as e:
            pytest.skip(f"chromium at {CHROMIUM} cannot start: {str(e).splitlines()[0]}")
        try:
            yield b
        finally:
            b.close()


def _failing_handoff(c: httpx.Client, root: str) -> str:
    """A real hand-off of rank 0 of 2 with a 1 s commit timeout: rank 1 never comes, so the job
    fails with its one-line reason. Its root is the XSS payload."""
    r = c.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 64, "client": "t"})
    assert r.status_code == 200, r.text
    lease = r.json()
    np.arange(4, dtype=np.float32).tofile(os.path.join(lease["dir"], "w.bin"))
    Path(lease["dir"], "m.bin").write_bytes(b"{}")
    job = {
        "job": "ab" * 16,
        "lease": lease["lease"],
        "root": root,
        "step": 7,
        "attempt": "evil1",
        "rank": 0,
        "world_size": 2,
        "commit_timeout": 1.0,
        "shards": [
            {
                "key": "w",
                "layout": {"shape": [4], "dtype": "float32", "shard_shape": [4], "chunk_shape": [4]},
                "coord": [0],
                "file": "w.bin",
            }
        ],
        "metadata": [{"key": "arrays/w/zarr.json", "file": "m.bin"}],
    }
    r = c.post("/v1/jobs", json=job)
    assert r.status_code == 200, r.text
    return job["job"]


@pytest.mark.timeout(300)
def test_status_page_in_a_browser(tmp_path, browser):
    served = tmp_path / "jobs"
    run = str(served / "run-1")
    evil_root = str(served / EVIL)
    flags = tmp_path / "flags"
    flags.mkdir()
    saver = None
    # Every put under arrays/ (each array's zarr.json, then each shard) sleeps 0.5 s, one put at a
    # time: the small saves commit in about 2 s each; the big one (64 arrays) puts metadata for
    # about 32 s, then shards for 32 s; the page is checked once a tenth of its bytes are up,
    # leaving it about 29 s of the upload.
    with Daemon(
        [str(served)],
        tmp_path / "staging",
        tmp_path / "daemon.log",
        upload_delay_s=0.5,
        CKPTD_IO_THREADS="1",
    ) as d:
        try:
            with d.client(timeout=60) as c:  # the failing hand-off: on the socket, as a trainer
                evil_job = _failing_handoff(c, evil_root)
                wait_for(
                    lambda: c.get(f"/v1/jobs/{evil_job}").json()["state"] == "failed", "the failure", 60, logs=d.logs
                )
                env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
                with open(tmp_path / "saver.log", "w") as log:
                    saver = subprocess.Popen(
                        [sys.executable, "-m", "tests.ops.saver", d.socket_url, run, str(flags)],
                        env=env,
                        cwd=str(ROOT),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )

                def in_flight():
                    jobs = [j for j in c.get("/v1/jobs").json() if j["step"] == 4 and j["root"] == run]
                    if not jobs or jobs[0]["state"] != "uploading":
                        return False
                    return jobs[0]["bytes_uploaded"] > jobs[0]["bytes_total"] // 10  # a bar to see

                logs = lambda: d.logs() + (tmp_path / "saver.log").read_text()  # noqa: E731
                wait_for(lambda: (flags / "handed_off").exists(), "the hand-off of step 4", 180, [saver], logs)
                wait_for(in_flight, "step 4 uploading", 150, [saver], logs)

                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.goto(d.url + "/")
                page.fill("#token", d.token)  # the page asks for the daemon's token once
                page.click("#tokenform button[type=submit]")
                page.wait_for_selector("#inflight tr.job")
                # rows: steps 1-3 committed, step 4 partial (being written), newest good = 3
                root_div = page.locator("div.root", has=page.locator("h3", has_text="run-1"))
                steps = root_div.locator("tr.ckpt td:first-child").all_text_contents()
                assert steps == ["4", "3", "2", "1"], steps
                states = root_div.locator("tr.ckpt td.state").all_text_contents()
                assert states == ["partial", "committed", "committed", "committed"], states
                assert root_div.locator(".newest").text_content() == "3"
                # progress of the save in flight: some bytes of its total, state uploading
                row = page.locator("#inflight tr.job")
                assert row.locator("td.jobstate").text_content() == "uploading"
                done, _, total = row.locator("td.uploaded").text_content().partition(" of ")
                assert done != total and not done.startswith("0 B"), (done, total)
                # the chart has the three committed saves
                assert page.locator("#saves-chart g.save").count() == 3
                # the XSS payload is shown as text, ran nowhere
                failure = page.locator("#failures tr.failure")
                assert failure.locator("td").nth(1).text_content() == evil_root
                assert "not committed" in failure.locator("td.bad").text_content()
                assert page.locator("div.root h3", has_text="onerror").text_content() == evil_root
                assert page.title() == "ckptd status"
                assert page.locator("#content img").count() == 0
                page.screenshot(path=str(tmp_path / "status-page.png"), full_page=True)
                # the page was checked while the save was still in flight
                assert c.get("/v1/jobs").json()[-1]["state"] in ("uploading", "uploaded")
                page.close()
        finally:
            if saver is not None and saver.poll() is None:
                saver.kill()
                saver.wait(timeout=30)
    if os.environ.get("CKPTD_UPDATE_DOCS") == "1":  # refresh the README's screenshot
        shutil.copyfile(tmp_path / "status-page.png", SCREENSHOT)


@pytest.mark.timeout(180)
def test_status_page_with_a_token(tmp_path, browser):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with Daemon([str(tmp_path / "jobs")], tmp_path / "staging", tmp_path / "daemon.log", token_file=token_file) as d:
        page = browser.new_page()
        page.goto(d.url + "/")
        page.wait_for_selector("#tokenform:not([hidden])")
        assert page.locator("#content").inner_html() == ""
        # every data route refuses the browser without the token
        for path in ("/v1/page", "/v1/overview", "/v1/checkpoints", "/metrics"):
            status = page.evaluate("p => fetch(p).then(r => r.status)", path)
            assert status == 401, path
        status = page.evaluate("() => fetch('/v1/page/verify?root=x&step=1', {method: 'POST'}).then(r => r.status)")
        assert status == 401
        page.fill("#token", "wrong")
        page.click("#tokenform button[type=submit]")
        page.locator("#tokenerror", has_text="refused").wait_for()
        page.fill("#token", TOKEN)
        page.click("#tokenform button[type=submit]")
        page.wait_for_selector("#roots .newest")
        assert page.locator("#roots .newest").text_content() == "none"
        assert TOKEN not in page.url
        assert page.evaluate("() => sessionStorage.getItem('ckpt-token')") is None
        assert page.evaluate("() => sessionStorage.getItem('ckptd-token')") == TOKEN
        page.close()
