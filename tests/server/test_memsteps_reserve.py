"""A memory-only step's reservation (``POST /v1/tiers/reserve``) takes room in the staging
budget, as a staging lease does, so it follows the lease rule of ``server.tenancy``: a caller
the kernel did not name (TCP without ``--trust-tcp``) or another identity's root is refused (403),
else another local user could hold the budget or replace a tenant's reservation."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from tests import load
from tests.distributed import launch
from tests.server.daemon import Daemon

pytestmark = pytest.mark.timeout(120)

TOKEN = "reserve-test-token-0123456789abcdef"


def test_a_memory_only_reservation_follows_the_lease_rule(tmp_path):
    # Room in the staging budget is what a lease takes: over TCP without --trust-tcp the caller is
    # nobody the kernel named, so it may not reserve it for any root (before: 200, room held).
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    d = Daemon([root], tmp_path / "staging", tmp_path / "d.log", token_file=tmp_path / "token", trust_tcp=False)
    d.start(port=launch.free_port())
    try:
        body = {"root": root, "step": 3, "attempt": "a1", "rank": 0, "bytes": 1 << 20, "objects": 4}
        req = urllib.request.Request(
            d.url + "/v1/tiers/reserve",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
                code = r.status
        except urllib.error.HTTPError as e:
            code = e.code
        assert code == 403, code
    finally:
        d.kill()
