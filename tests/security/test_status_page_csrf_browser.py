"""Issue 27 item 8, in a real browser: a page of another origin (another port on the same host,
so "same-site" but not same-origin) submits a form to the ``--insecure-no-auth`` daemon's
``POST /v1/page/verify``, as any web page an operator visits could. The daemon answers 403 and
runs no verify; the status page itself still verifies (its button, same origin)."""

from __future__ import annotations

import html
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlencode

import httpx
import pytest

from tests.ops.test_status_page import browser  # noqa: F401 - the chromium fixture
from tests.security.conftest import make_root
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _serve(body: str) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def test_a_cross_origin_form_cannot_start_a_verify(tmp_path, browser):  # noqa: F811
    root = str(make_root(tmp_path / "jobs", steps=(1,)))
    # --insecure-no-auth: a cross-site form is the attack on a page without a token
    with Daemon([root], tmp_path / "staging", tmp_path / "daemon.log", insecure_no_auth=True) as d:
        action = f"{d.url}/v1/page/verify?{urlencode({'root': root, 'step': 1})}"
        evil = (
            f'<html><body><form id="f" method="POST" action="{html.escape(action)}">'
            '<input type="hidden" name="x" value="1"></form>'
            '<script>document.getElementById("f").submit()</script></body></html>'
        )
        srv, url = _serve(evil)
        try:
            page = browser.new_page()
            with page.expect_response(lambda r: "/v1/page/verify" in r.url) as got:
                page.goto(url)
            assert got.value.status == 403, got.value.text()
            with httpx.Client(base_url=d.url, timeout=30) as c:
                row = c.get("/v1/overview").json()["roots"][0]["checkpoints"][0]
                assert row["state"] == "committed" and "verify" not in row  # no verify ran
            # the status page's own button still verifies
            page.goto(d.url + "/")
            page.click('button[data-action="verify"]')
            page.locator("td.state", has_text="verified").wait_for()
            page.close()
        finally:
            srv.shutdown()
            srv.server_close()
