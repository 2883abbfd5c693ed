"""Issue 36 item 4: the memory tier is shared fairly between its origins (``Tiers.over_share``).

Two real local users, alice and bob, train through one real ``ckptd serve`` run as the docs
print it (a token file, its Unix socket, no ``--trust-tcp``), under a low ``RLIMIT_NOFILE`` so
that the tier's object cap (``server.capacity``) is a few hundred objects. Bob, with the token,
floods the tier through the socket hand-off path with memory-only steps of many one-element
tensors into folders of his own root, ever smaller, until the daemon refuses them (persisted
instead). Then alice saves a committed step and a memory-only step into her root: both stay in
memory (her hot copy held, her memory-only step never written to her root), and her restore
reads them from the tier. Before, bob's objects filled the cap: her hot copy was not kept and
her memory-only step was persisted instead (the issue's 7,493 one-byte objects).
"""

from __future__ import annotations

import resource
import shutil

import pytest

from ckptd import manifest as mf
from ckptd.daemon_conn import DaemonConnection
from tests.security.test_tenancy import ALICE, BOB, GROUP, TOKEN, Tenant, _expected, tenant_tree, tenants  # noqa: F401
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NOFILE = 800  # the daemon's open-files limit (soft and hard): a tier of ~250 objects


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _tiers(d: Daemon) -> dict:
    """``GET /v1/tiers`` as an operator sees it (root, on the daemon's socket)."""
    conn = DaemonConnection(d.socket_url, TOKEN)
    try:
        status, body, _ = conn.call("GET", "/v1/tiers")
    finally:
        conn.close()
    assert status == 200, body
    return body


def test_a_tenant_flooding_the_tier_with_tiny_objects_leaves_the_others_their_share(tenants):  # noqa: F811
    base, token, jobs, roots, works = tenant_tree("share", tenants)
    d = Daemon(
        [str(jobs)],
        base / "staging",
        base / "daemon.log",
        token_file=token,
        trust_tcp=False,
        preexec_fn=_low_nofile,
        CKPTD_STAGING_GROUP=GROUP,
    )
    started: list[Tenant] = []
    try:
        with d:
            addr = d.socket_url
            cap = d.metric("ckptd_tier_objects_limit", TOKEN)
            assert 0 < cap < 1000, cap
            bob = Tenant(tenants[BOB], works[BOB], token)
            started.append(bob)
            # Bob floods: memory-only steps (persist_every 1000) of T tiny tensors, each in a
            # folder of his root (one root keeps two such steps), ever smaller, until a step of
            # one tensor is refused too.
            tensors, k, refused = 64, 0, 0
            while True:
                before = d.metric("ckptd_tier_persisted_instead_total", TOKEN)
                folder = f"{roots[BOB]}/f{k}"
                assert bob(op="open", root=folder, daemon=addr, persist_every=1000) == {"ok": True}
                assert bob(op="save", step=1, seed=k, tensors=tensors) == {"ok": True}
                k += 1
                if d.metric("ckptd_tier_persisted_instead_total", TOKEN) > before:
                    refused += 1
                    if tensors == 1:
                        break
                    tensors = max(1, tensors // 4)
                assert k < 200, "bob's flood never ended"
            bob_held = d.metric("ckptd_tier_objects", TOKEN)
            # Alice: a committed step (its hot copy) and a memory-only step, into her own root.
            alice = Tenant(tenants[ALICE], works[ALICE], token)
            started.append(alice)
            persisted = d.metric("ckptd_tier_persisted_instead_total", TOKEN)
            root = str(roots[ALICE])
            assert alice(op="open", root=root, daemon=addr, persist_every=2) == {"ok": True}
            assert alice(op="save", step=2, seed=2) == {"ok": True}
            assert alice(op="save", step=3, seed=3) == {"ok": True}
            tiers = _tiers(d)
            why = (k, refused, cap, bob_held, tiers.get("origins"), d.logs()[-3000:])
            assert d.metric("ckptd_tier_persisted_instead_total", TOKEN) == persisted, why
            assert not (roots[ALICE] / mf.step_dir(3)).exists(), why  # held in memory, never written
            assert [c["step"] for c in tiers["hot"] if c["root"].endswith(f"/{ALICE}")] == [2], why
            assert [p["step"] for p in tiers["memory_only"] if p["root"].endswith(f"/{ALICE}")] == [3], why
            got = alice(op="restore", root=root, daemon=addr, tiers=True)
            assert got["step"] == 3 and got["digest"] == _expected(3), (got, why)
            assert got["tiers"].get("local", 0) > 0 and got["tiers"].get("root", 0) == 0, (got, why)
            # Bob held no more than his share, and the daemon said so once.
            origins = tiers["origins"]
            bob_uid, alice_uid = tenants[BOB].pw_uid, tenants[ALICE].pw_uid
            assert 0 < origins[f"uid {bob_uid}"]["objects"] <= cap * tiers["tenant_share"], why
            assert origins[f"uid {alice_uid}"]["objects"] > 0, why
            assert d.log_path.read_text().count(f"memory tier: uid {bob_uid} holds its share of the tier (") == 1, why
            scrape = d.get("/metrics", TOKEN)[1]
            assert f'ckptd_tier_origin_objects{{origin="uid {bob_uid}"}}' in str(scrape), scrape
    finally:
        for t in started:
            t.close()
        shutil.rmtree(base, ignore_errors=True)
