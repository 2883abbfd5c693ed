"""Issue 27 item 8: the status page against a hostile job root and a hostile web page.

A root whose ``commit.json`` carries strings where ``time`` and ``bytes`` belong shows that step
as an unreadable row; the other roots show as before (``/v1/page`` never 500s). In
``--insecure-no-auth`` mode a cross-site POST (a form on another site, a foreign ``Origin``,
``Sec-Fetch-Site: cross-site``, or no ``X-Ckptd-Page`` header) cannot start a verify: 403. A real
daemon over loopback, a real forged record."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.security.conftest import make_root
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture
def served(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_root(good, steps=(1,))
    make_root(bad, steps=(1, 2))
    commit = bad / "step_0000000002" / "commit.json"
    rec = json.loads(commit.read_text())
    rec.update(time="yesterday", bytes="lots")
    commit.write_text(json.dumps(rec))
    # --insecure-no-auth: the mode whose cross-site POSTs this checks (no token stops them)
    with Daemon([str(good), str(bad)], tmp_path / "staging", tmp_path / "daemon.log", insecure_no_auth=True) as d:
        yield d, str(good), str(bad)


def test_a_forged_commit_record_breaks_one_row_not_the_page(served):
    d, good, bad = served
    with httpx.Client(base_url=d.url, timeout=30) as c:
        r = c.get("/v1/page")
        assert r.status_code == 200, r.text
        html = r.json()["html"]
        assert html.count('class="root"') == 2
        assert "state-unreadable" in html and "&#x27;lots&#x27;, not a number" in html, html
        assert html.count("state-committed") == 2  # good's step 1 and bad's step 1
        ov = c.get("/v1/overview").json()
        rows = {r["root"]: r for r in ov["roots"]}
        assert rows[good]["newest_good_step"] == 1
        assert rows[bad]["newest_good_step"] == 1  # the forged step is not "good"
        assert [x["state"] for x in rows[bad]["checkpoints"]] == ["unreadable", "committed"]


def test_cross_site_posts_cannot_start_a_verify(served):
    d, good, _ = served
    q = {"root": good, "step": 1}
    page = {"X-Ckptd-Page": "1"}
    with httpx.Client(base_url=d.url, timeout=60) as c:
        foreign = [
            {},  # a form post: no custom header
            {"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"},
            page | {"Origin": "http://evil.example"},
            page | {"Origin": "null"},
            page | {"Origin": d.url.replace("127.0.0.1", "localhost")},  # another origin, same daemon
            page | {"Sec-Fetch-Site": "cross-site"},
            page | {"Sec-Fetch-Site": "same-site"},
        ]
        for headers in foreign:
            r = c.post("/v1/page/verify", params=q, headers=headers)
            assert r.status_code == 403, (headers, r.text)
        r = c.post("/v1/leases", json={"root": good, "rank": 0, "bytes": 1, "client": "x"}, headers=foreign[2])
        assert r.status_code == 403, r.text
        assert "verify" not in c.get("/v1/overview").json()["roots"][0]["checkpoints"][0]
        # the page itself (same origin, its header) still verifies
        same = page | {"Origin": d.url, "Sec-Fetch-Site": "same-origin"}
        r = c.post("/v1/page/verify", params=q, headers=same)
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert c.post("/v1/page/verify", params=q, headers=page).status_code == 200  # curl-like: no Origin
