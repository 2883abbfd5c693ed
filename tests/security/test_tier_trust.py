"""Issue 36: the memory tier trusts the wrong party. Two real local users, alice and bob, both
holding the trainers' token (the staging group's), and two real daemons (root) of one ring,
started as the docs print them: token file, each daemon's Unix socket, the peer key, never
``--trust-tcp``. alice trains through daemon A with memory-only steps (``persist_every``),
which A replicates to its peer B.

* bob fences alice's root on the peer (``POST /v1/tiers/restored`` with her root and an older
  step), over TCP and over B's socket: before, B dropped her replica, and after the loss of
  A's node her restore went back to her last persisted step; now 403, her replica stays and her
  restore returns the memory-only step's weights bitwise. (A rank fences its own daemon, which
  forwards the fence signed to its peers.)
* bob lists ``/v1/tiers``, ``/v1/overview`` and ``/v1/page`` on A: before, he saw alice's root
  (its steps, parts, sizes); now he sees only what he may read, and ``/v1/tiers?root=`` of her
  root is 403.
* bob on the peer B, where alice's root was unbound (bindings were per daemon): before, he listed
  her root in B's ``/v1/tiers`` and read her replica's bytes (``/v1/tiers/read`` and the tier
  data path); now the replica carries her binding from A (signed), B reads her root as hers: 403,
  while alice reads it over B's socket and restores her memory-only step through B.
"""

from __future__ import annotations

import hashlib
import json
import pwd
import shutil
from pathlib import Path

import pytest

from tests.distributed import launch
from tests.security.test_tenancy import ALICE, BOB, GROUP, Tenant, _expected, _operator, tenant_tree
from tests.security.test_tenancy import tenants as tenants  # the fixture
from tests.server.daemon import node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PERSIST_EVERY = 10


@pytest.fixture
def ring(tenants, request):
    """Daemons A and B (root) serving ``jobs/``, one ring; alice's and bob's roots (theirs);
    alice has saved step 10 (persisted) and memory-only step 11 through A, replicated to B.
    Parametrized indirectly with "trust-tcp", the daemons run with ``--trust-tcp``."""
    flags = dict(trust_tcp=True) if getattr(request, "param", "docs") == "trust-tcp" else {}
    base, token, jobs, paths, works = tenant_tree("t36", tenants)  # ``node`` reads the token at base
    roots = {name: str(d) for name, d in paths.items()}
    ports = [launch.free_port(), launch.free_port()]
    peers = [f"http://127.0.0.1:{p}" for p in ports]
    daemons = []
    started: list[Tenant] = []
    try:
        for name, port in zip("ab", ports, strict=True):
            daemons.append(node(base, name, str(jobs), port, peers, CKPTD_STAGING_GROUP=GROUP, **flags))
        a, b = daemons

        def tenant(name: str) -> Tenant:
            t = Tenant(tenants[name], Path(works[name]), token)
            started.append(t)
            return t

        alice = tenant(ALICE)
        root = roots[ALICE]
        assert alice(op="open", root=root, daemon=a.socket_url, persist_every=PERSIST_EVERY) == {"ok": True}
        for step in (PERSIST_EVERY, PERSIST_EVERY + 1):
            assert alice(op="save", step=step, seed=step) == {"ok": True}
        wait_for(lambda: _parts(b, root), "alice's memory-only replica on B", 60, logs=b.logs)
        yield {"a": a, "b": b, "alice": alice, "bob": tenant(BOB), "roots": roots}
    finally:
        for t in started:
            t.close()
        for d in daemons:
            d.kill()
        shutil.rmtree(base, ignore_errors=True)


def tenants_uid(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def _parts(d, root: str) -> list[dict]:
    """The memory-only parts of ``root`` that daemon ``d`` holds (asked as root, an operator)."""
    with _operator({"addr": d.socket_url}) as op:
        return op.get("/v1/tiers", params={"root": root}).json()["memory_only"]


def test_bob_cannot_fence_alices_replicas_on_a_peer(ring):
    a, b, alice, bob, root = ring["a"], ring["b"], ring["alice"], ring["bob"], ring["roots"][ALICE]
    (held,) = _parts(b, root)
    assert held["step"] == PERSIST_EVERY + 1 and held["source"] == a.url, held
    fence = {"job_root": root, "restored_step": PERSIST_EVERY}
    for d in (b, a):  # the peer that holds her replica, and her own daemon
        for addr in (d.url, d.socket_url):
            r = bob(op="http", daemon=addr, method="POST", path="/v1/tiers/restored", body=fence)
            assert r["status"] == 403, (addr, r)
    assert [p["step"] for p in _parts(b, root)] == [PERSIST_EVERY + 1]
    # A's node is lost: its memory with it; the restarted daemon holds nothing, B her replica.
    a.kill()
    a.start(port=a.port)
    assert _parts(a, root) == []
    got = alice(op="restore", root=root, daemon=a.socket_url)
    assert got == {"step": PERSIST_EVERY + 1, "digest": _expected(PERSIST_EVERY + 1)}, (got, b.logs())
    # her own restore fenced through A, which told B (signed): step 11 is not newer, still held
    assert [p["step"] for p in _parts(b, root)] == [PERSIST_EVERY + 1]


def test_bob_does_not_see_alices_root_in_the_listings(ring):
    a, alice, bob, root = ring["a"], ring["alice"], ring["bob"], ring["roots"][ALICE]
    assert bob(op="open", root=ring["roots"][BOB], daemon=a.socket_url) == {"ok": True}
    assert bob(op="save", step=1, seed=1) == {"ok": True}
    for addr in (a.socket_url, a.url):
        for path in ("/v1/tiers", "/v1/overview", "/v1/page"):
            r = bob(op="http", daemon=addr, method="GET", path=path)
            assert r["status"] == 200, (addr, path, r)
            assert root not in json.dumps(r["body"]), (addr, path, r)
        r = bob(op="http", daemon=addr, method="GET", path=f"/v1/tiers?root={root}")
        assert r["status"] == 403, (addr, r)
    # bob sees his own root on the socket; alice hers
    r = bob(op="http", daemon=a.socket_url, method="GET", path="/v1/overview")
    assert ring["roots"][BOB] in json.dumps(r["body"]), r
    r = alice(op="http", daemon=a.socket_url, method="GET", path="/v1/tiers")
    assert [p["root"] for p in r["body"]["memory_only"]] == [root], r
    r = alice(op="http", daemon=a.socket_url, method="GET", path="/v1/overview")
    assert root in [x["root"] for x in r["body"]["roots"]], r


def test_a_replica_carries_its_roots_binding_to_the_peer(ring):
    a, b, alice, bob, root = ring["a"], ring["b"], ring["alice"], ring["bob"], ring["roots"][ALICE]
    with _operator({"addr": b.socket_url}) as op:
        got = op.get("/v1/tiers", params={"root": root, "keys": "true"}).json()
        (held,) = got["memory_only"]
        step = {"root": root, "step": held["step"], "attempt": held["attempt"]}
        ranges = [[k, 0, n] for k, n in sorted(held["keys"].items())]
        body = step | {"ranges": [{"key": k, "start": s, "length": n} for k, s, n in ranges]}
        want = op.post("/v1/tiers/read", json=body)
        assert want.status_code == 200 and len(want.content) == held["bytes"] > 0, want
    data = got["data"]
    for addr in (b.url, b.socket_url):
        r = bob(op="http", daemon=addr, method="GET", path="/v1/tiers")
        assert r["status"] == 200 and root not in json.dumps(r["body"]), (addr, r)
        r = bob(op="http", daemon=addr, method="GET", path=f"/v1/tiers?root={root}")
        assert r["status"] == 403, (addr, r)
        r = bob(op="http", daemon=addr, method="POST", path="/v1/tiers/read", body=body)
        assert r["status"] == 403, (addr, r)
    read = step | {"op": "read", "ranges": ranges}
    for where in ({"socket": data["socket"]}, {"port": data["port"]}):
        r = bob(op="data", request=read, **where)
        assert r["ok"] is False and r["status"] == 403, (where, r)
    # a rank of another node reads over TCP as the ticket its own daemon signed names it
    # (``GET /v1/tiers/vouch`` on that daemon's socket): bob's names bob, and his altered one nobody
    tickets = {}
    for who, t in ((BOB, bob), (ALICE, alice)):
        assert t(op="http", daemon=b.url, method="GET", path=f"/v1/tiers/vouch?root={root}")["status"] == 403
        tickets[who] = t(op="http", daemon=a.socket_url, method="GET", path=f"/v1/tiers/vouch?root={root}")
    assert tickets[BOB]["status"] == 403, tickets  # A vouches for a reader of a root it may read there
    tickets = {who: r["body"]["vouch"] for who, r in tickets.items() if r["status"] == 200}
    other = f"{root}-other"  # unbound: alice may read it, and a ticket for it is not one for her root
    r = bob(op="http", daemon=a.socket_url, method="GET", path=f"/v1/tiers/vouch?root={root}-bob")
    tickets[BOB] = r["body"]["vouch"]
    r = alice(op="http", daemon=a.socket_url, method="GET", path=f"/v1/tiers/vouch?root={other}")
    elsewhere = r["body"]["vouch"]
    rest = tickets[BOB].partition(" ")[2]
    forged = f"{tenants_uid(ALICE)} {rest}"
    for ticket in (tickets[BOB], forged, elsewhere):
        r = bob(op="http", daemon=b.url, method="POST", path="/v1/tiers/read", body=body, vouch=ticket)
        assert r["status"] == 403, r
        r = bob(op="data", request=read | {"vouch": ticket}, port=data["port"])
        assert r["ok"] is False and r["status"] == 403, r
    r = alice(op="data", request=read | {"vouch": tickets[ALICE]}, port=data["port"])
    assert r["ok"] and r["sha256"] == hashlib.sha256(want.content).hexdigest(), r
    fence = {"job_root": root, "restored_step": PERSIST_EVERY}  # a ticket reads, never writes
    r = alice(op="http", daemon=b.url, method="POST", path="/v1/tiers/restored", body=fence, vouch=tickets[ALICE])
    assert r["status"] == 403, r
    # alice, on B's socket, reads and lists her replica
    r = alice(op="data", request=read, socket=data["socket"])
    assert r["ok"] and r["sha256"] == hashlib.sha256(want.content).hexdigest(), r
    r = alice(op="http", daemon=b.socket_url, method="POST", path="/v1/tiers/read", body=body)
    assert r["status"] == 200, r
    r = alice(op="http", daemon=b.socket_url, method="GET", path="/v1/tiers")
    assert [p["root"] for p in r["body"]["memory_only"]] == [root], r
    # held in memory only: B wrote no binding of her root into its own table
    bindings = Path(b.staging) / "bindings.json"
    assert not bindings.exists() or root not in bindings.read_text()
    # A's node is lost; alice's job restarts on B and restores through B: her memory-only step
    a.kill()
    got = alice(op="restore", root=root, daemon=b.socket_url)
    assert got == {"step": PERSIST_EVERY + 1, "digest": _expected(PERSIST_EVERY + 1)}, (got, b.logs())


@pytest.mark.parametrize("ring", ["docs", "trust-tcp"], indirect=True)
def test_bob_cannot_push_a_memory_only_step_into_alices_root(ring):
    """bob saves a memory-only step 12 of his own (other weights) through A, reads its bytes
    back (his root) and pushes them with the token as step 12 of alice's root, over A's TCP port
    and over A's socket (where the kernel names him), claiming ``source`` "self": 403 each time,
    and her next restore returns her own step 11. Before, each push was taken and her restore
    returned his weights from the tier. Also with ``--trust-tcp``."""
    a, alice, bob, root = ring["a"], ring["alice"], ring["bob"], ring["roots"][ALICE]
    mine, step = ring["roots"][BOB], PERSIST_EVERY + 2
    assert bob(op="open", root=mine, daemon=a.socket_url, persist_every=PERSIST_EVERY) == {"ok": True}
    assert bob(op="save", step=step, seed=666) == {"ok": True}
    for addr in (a.url, a.socket_url):
        r = bob(op="push", daemon=addr, root=root, step=step, copy={"daemon": a.socket_url, "root": mine, "step": step})
        got = alice(op="restore", root=root, daemon=a.socket_url)
        assert got == {"step": PERSIST_EVERY + 1, "digest": _expected(PERSIST_EVERY + 1)}, (addr, r, got)
        assert r["statuses"] == [403], (addr, r)
    assert [p["step"] for p in _parts(a, root)] == [PERSIST_EVERY + 1]


def test_bob_cannot_drop_alices_memory_only_step_with_a_one_byte_part(ring):
    """bob pushes a 1-byte part of alice's memory-only step 11 (its attempt, rank 0) to A
    claiming ``source`` "self", A's own copy, over TCP and A's socket: 403, A still holds her
    step and her restore returns it. Before, A took the byte for her own hand-off and dropped
    her step: her restore went back to step 10."""
    a, alice, bob, root = ring["a"], ring["alice"], ring["bob"], ring["roots"][ALICE]
    (held,) = _parts(a, root)
    assert held["source"] == "self", held
    key = f"step_{held['step']:010d}/manifest.json"
    for addr in (a.url, a.socket_url):
        r = bob(op="push", daemon=addr, root=root, step=held["step"], attempt=held["attempt"], objects={key: "x"})
        got = alice(op="restore", root=root, daemon=a.socket_url)
        assert got == {"step": PERSIST_EVERY + 1, "digest": _expected(PERSIST_EVERY + 1)}, (addr, r, got)
        assert r["statuses"] == [403], (addr, r)
    assert [(p["step"], p["source"]) for p in _parts(a, root)] == [(PERSIST_EVERY + 1, "self")]
