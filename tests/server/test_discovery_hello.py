"""The discovery challenge (``GET /v1/tiers/hello``) needs no token and answers a MAC keyed by
the token: whoever reaches it could test guesses of the token offline. So only a daemon that is
itself in a discovered ring (``--discover``) answers it; a daemon with a token and an advertised
URL but no discovery (the ``--peers`` ring, or none) answers 404 and no MAC, while the rest of
its API still needs the token (401)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from tests import load
from tests.distributed import launch
from tests.server.daemon import node

pytestmark = pytest.mark.timeout(120)

TOKEN = "hello-test-token-0123456789abcdef"


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=load.scaled(10)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_daemon_outside_a_discovered_ring_offers_no_mac(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    port = launch.free_port()
    d = node(tmp_path, "a", f"file://{tmp_path / 'job'}", port, [f"http://127.0.0.1:{port}"])
    try:
        code, body = _get(f"{d.url}/v1/tiers/hello?nonce={'ab' * 32}")
        assert code == 404 and "mac" not in body, (code, body)
        assert _get(f"{d.url}/v1/tiers")[0] == 401  # the token still guards the rest
    finally:
        d.kill()
