"""Memory-only steps (``Checkpointer(..., persist_every=K)``, ``ckptd.server.tiers``,
``trainer_hooks.memsteps``) with real daemons on loopback as 2 nodes (each its own staging
folder and port, one token): a 4-rank gloo job, 2 ranks per node, saves every step, persisting
every 5th (steps 1..7: step 5 in the job root, the others in the daemons' memory only).

- One node fails (SIGKILL of its daemon and its ranks) after step 7's save returned and its
  parts were replicated: the job restores step 7 at 3 ranks (on the surviving node) and at 2
  ranks (on a new node, from the survivor's memory), bitwise, with 0 bytes from the job root,
  the data position exact (no step replayed); then every daemon is gone: the job falls back to
  the persisted step 5.
- A node fails during step 7's save (its ranks never hand their part off): step 7 is not whole
  in any tier, the restore picks step 6 (whole: the survivor's parts and its replicas of the
  dead node's), and the restore fences step 7's parts away on the survivor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.cli.tiers_view import tier_copies
from ckptd.daemon_conn import PEER_HEADER, peer_auth
from ckptd.errors import CheckpointError
from storage_backends import open_store
from tests import load
from tests.distributed import launch
from tests.distributed.scenarios import BATCH
from tests.server.daemon import PEER_KEY, ROOT, Daemon, kill_all, node, tier_totals, wait_for
from tests.server.memstep_scenarios import DATASET, PER_STEP
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(900)

SCENARIOS = "tests.server.memstep_scenarios"
TOKEN = "memstep-test-token-0123456789"
LAST, EVERY = 7, 5


def _run(world: int, scenario: str, out: Path, **args) -> list[dict]:
    procs = launch.spawn(world, scenario, args, out, {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
    return launch.wait(procs, out, scenario, timeout=600)


def _parts(d: Daemon, root: str) -> list[dict]:
    status, body = d.get(f"/v1/tiers?root={root}&keys=true", TOKEN)
    assert status == 200, body
    return body["memory_only"]  # type: ignore[index]


def _post(d: Daemon, path: str, body: dict, token: str | None = TOKEN, signed: bool = True) -> int:
    """``body`` POSTed to ``d``; ``signed``: as a peer daemon (the peer key of ``node``)."""
    raw = json.dumps(body).encode()
    req = urllib.request.Request(d.url + path, raw, {"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if signed:
        req.add_header(PEER_HEADER, peer_auth(PEER_KEY.encode(), "http://127.0.0.1:9", "POST", path, raw))
    try:
        with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _has(d: Daemon, root: str, step: int, ranks: set[int], source: str | None = None) -> bool:
    got = {p["rank"] for p in _parts(d, root) if p["step"] == step and (source is None or p["source"] == source)}
    return ranks <= got


def _logs(out: Path, *daemons: Daemon) -> str:
    """The ranks' log tails and the daemons' (a failure names what each side last did)."""
    return launch.logs(out, "save_memory", 4) + "".join(f"\n--- {d.log_path.name} ---\n{d.logs()}" for d in daemons)


def _setup(tmp_path: Path, **b_args):
    """Two node daemons a and b (``b_args``: node b's own options) with a token file, as the docs
    run them (trainers on each node's socket)."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    pa, pb = launch.free_port(), launch.free_port()
    urls = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"]
    a = node(tmp_path, "a", root, pa, urls)
    b = node(tmp_path, "b", root, pb, urls, **b_args)
    return root, a, b, urls


def _restored(results: list[dict], step: int) -> dict[str, int]:
    assert all(r["step"] == step for r in results), results
    assert results[0]["mismatches"] == [], results[0]["mismatches"]  # bitwise, data position included
    # The data position: the samples of steps 1..step exactly (4 ranks' batches per step); the
    # job resumes at step + 1, so every sample is seen exactly once across the failure.
    assert all(r["position"] == step * BATCH * 4 for r in results), results
    return tier_totals(results)


def test_node_loss_after_the_save_restores_the_memory_only_step(tmp_path):
    root, a, b, urls = _setup(tmp_path)
    out = tmp_path / "out"
    c = None
    procs = []
    try:
        args = {"daemons": [a.socket_url, b.socket_url], "root": root, "last": LAST, "persist_every": EVERY}
        procs = launch.spawn(4, "save_memory", args, out, {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
        wait_for(
            lambda: all((out / f"saved_{r}").exists() for r in range(4)),
            "the saves",
            600,
            procs,
            lambda: _logs(out, a, b),
        )
        # Step 7's parts replicated: a holds b's (ranks 2, 3) and b holds a's.
        wait_for(lambda: _has(a, root, LAST, {2, 3}, urls[1]) and _has(b, root, LAST, {0, 1}, urls[0]), "replicas", 120)
        # Only step 5 was written under the job root; the others are memory-only, shown so.
        job = tmp_path / "job"
        assert sorted(p.name for p in job.iterdir() if p.name.startswith("step_")) == [mf.step_dir(EVERY)]
        copies, failed = tier_copies(root, a.url, TOKEN)
        assert not failed and {c["kind"] for c in copies[LAST]} == {"memory", "memory-replica"}, copies
        # Each daemon keeps the newest 2 memory-only steps (own parts, and replicas per source).
        assert {p["step"] for p in _parts(a, root)} == {6, 7}

        # Node b fails: its daemon and its ranks are SIGKILLed; the job's other ranks go too.
        b.kill()
        kill_all(procs)

        ref = str(out / f"ref_step{LAST}.pt")
        shared = a.metric("ckptd_tier_bytes_shared_total", TOKEN)
        res = _run(3, "restore_position", out / "r3", daemon=a.socket_url, root=root, ref=ref)
        got = _restored(res, LAST)
        assert got["root"] == 0 and got["local"] > 0, got
        assert a.metric("ckptd_restore_bytes_local_total", TOKEN) == got["local"]
        assert a.metric("ckptd_restore_bytes_root_total", TOKEN) == 0
        # The node's own daemon lent its parts as sealed memory, as it does a hot copy's: each of
        # the 3 ranks mapped every object a holds (step 7's, own and b's replicas) at least once.
        assert a.metric("ckptd_tier_bytes_shared_total", TOKEN) - shared >= got["local"], got
        assert LAST - res[0]["step"] <= 1  # lost work after the node failure: at most 1 step (here 0)

        pc = launch.free_port()  # a new node: empty memory, peers a and the dead b
        c = node(tmp_path, "c", root, pc, [*urls, f"http://127.0.0.1:{pc}"])
        asked = a.metric("ckptd_tier_object_requests_total", TOKEN)
        on_data = a.metric("ckptd_tier_data_requests_total", TOKEN)
        served = a.metric("ckptd_tier_bytes_served_total", TOKEN)
        res = _run(2, "restore_position", out / "r2", daemon=c.socket_url, root=root, ref=ref)
        got = _restored(res, LAST)
        assert got["root"] == 0 and got["local"] == 0 and got["peer"] > 0, got
        # The peer's parts came over the tier's data path (every read a answered was asked there,
        # none over HTTP), counted by a like any tier read; the step's checks (manifest, done
        # records, on rank 0) too.
        asked = a.metric("ckptd_tier_object_requests_total", TOKEN) - asked
        assert asked > 0 and a.metric("ckptd_tier_data_requests_total", TOKEN) - on_data == asked, asked
        assert a.metric("ckptd_tier_bytes_served_total", TOKEN) - served >= got["peer"], got

        # Every daemon gone: the memory-only steps with them; the persisted step 5 is the floor.
        a.kill()
        c.kill()
        c = node(tmp_path, "c2", root, launch.free_port(), [])
        res = _run(
            2, "restore_position", out / "rfloor", daemon=c.socket_url, root=root, ref=str(out / f"ref_step{EVERY}.pt")
        )
        got = _restored(res, EVERY)
        assert got["root"] > 0, got
    finally:
        kill_all(procs)
        for d in (a, b, c):
            if d is not None:
                d.kill()


def test_the_documented_daemon_path_survives_a_node_loss(tmp_path):
    """README "Through the daemon" and "Recovery from the daemons' memory" as printed: two node
    daemons with a token file on their default sockets (``CKPTD_SOCKET``, one per node as two
    machines would have), no --trust-tcp; a 4-rank job with ``daemon=True`` and
    ``persist_every=3`` (2 ranks per node, each rank's environment naming its node's socket).
    Node b dies (its daemon and ranks SIGKILLed) after step 5: the job resumes from the tiers at
    3 ranks and at 2 (on a new node), bitwise, 0 bytes from the root, every sample once; ``ckptd
    ls --daemon unix://...`` shows the memory-only steps."""
    last, every = 5, 3
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    ports = {n: launch.free_port() for n in "abc"}
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    socks = {n: str(tmp_path / f"node-{n}" / "ckptd.sock") for n in "abc"}
    env = {"CKPTD_TOKEN_FILE": str(tmp_path / "token")}

    def start(n: str, peers: list[str]) -> Daemon:
        return node(tmp_path, n, root, ports[n], peers, trust_tcp=False, CKPTD_SOCKET=socks[n])

    def resume(world: int, n: str, out: Path) -> list[dict]:
        ref = str(tmp_path / "out" / f"ref_step{last}.pt")
        procs = launch.spawn(
            world,
            "resume_sampled",
            {"root": root, "ref": ref},
            out,
            {**env, "CKPTD_SOCKET": socks[n]},
            scenarios=SCENARIOS,
        )
        res = launch.wait(procs, out, "resume_sampled", timeout=600)
        assert all(r["step"] == last for r in res) and res[0]["mismatches"] == [], res
        got = tier_totals(res)
        assert got["root"] == 0, got
        rest = [i for r in res for i in r["rest"]]  # every sample once: drawn before, or after
        assert sorted(seen + rest) == list(range(DATASET)), (len(seen), len(rest))
        return got

    a = b = c = None
    procs = []
    try:
        a, b = start("a", [urls["a"], urls["b"]]), start("b", [urls["a"], urls["b"]])
        out = tmp_path / "out"
        args = {"root": root, "last": last, "persist_every": every}
        procs = launch.spawn(
            4, "save_sampled", args, out, lambda r: {**env, "CKPTD_SOCKET": socks["ab"[r // 2]]}, scenarios=SCENARIOS
        )
        wait_for(
            lambda: all((out / f"saved_{r}").exists() for r in range(4)),
            "the saves",
            600,
            procs,
            lambda: launch.logs(out, "save_sampled", 4),
        )
        wait_for(lambda: _has(a, root, last, {2, 3}, urls["b"]), "b's parts of step 5 replicated to a", 120)
        seen = [i for r in range(4) for i in json.loads((out / f"seen_{r}.json").read_text())]
        assert len(seen) == last * 4 * PER_STEP
        ls = subprocess.run(
            [sys.executable, "-m", "ckptd.cli.main", "ls", root, "--daemon", f"unix://{socks['a']}", "--json"],
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ls.returncode == 0 and "not listed" not in ls.stderr, ls.stderr
        rows = {row["step"]: row for row in json.loads(ls.stdout)}
        assert rows[every]["committed"] and all(rows[s]["memory_only"] for s in (4, 5)), rows

        b.kill()  # node b fails: its daemon and its ranks
        kill_all(procs)
        got = resume(3, "a", tmp_path / "r3")
        assert got["local"] > 0, got
        c = start("c", [urls["a"], urls["b"], urls["c"]])  # a new node, empty memory
        got = resume(2, "c", tmp_path / "r2")
        assert got["local"] == 0 and got["peer"] > 0, got
    finally:
        kill_all(procs)
        for d in (a, b, c):
            if d is not None:
                d.kill()


def test_each_rank_reads_its_own_nodes_parts_through_its_socket(tmp_path):
    """Ranks that reach their node's daemon on its Unix socket (an address only that node can
    use) still read their own node's parts as this node's: mapped from its sealed memory, not
    through another node's address. Each rank's restore reads local bytes."""
    root, a, b, urls = _setup(tmp_path)
    out = tmp_path / "out"
    try:
        args = {
            "daemons": [a.socket_url, b.socket_url],
            "root": root,
            "last": LAST,
            "persist_every": EVERY,
            "hang": False,
        }
        _run(4, "save_memory", out, **args)
        wait_for(lambda: _has(a, root, LAST, {2, 3}, urls[1]) and _has(b, root, LAST, {0, 1}, urls[0]), "replicas", 120)
        ref = str(out / f"ref_step{LAST}.pt")
        res = _run(4, "restore_position", out / "r4", daemon=[a.socket_url, b.socket_url], root=root, ref=ref)
        _restored(res, LAST)
        assert all(r["tiers"]["root"] == 0 and r["tiers"]["local"] > 0 for r in res), [r["tiers"] for r in res]
    finally:
        a.kill()
        b.kill()


def _restore_beside_a_silent_peer(tmp_path: Path, silence: str, last: int, every: int) -> tuple[dict, int]:
    """Nodes a and b as the docs run them (a token, each node's socket, no --trust-tcp); a
    2-rank job (rank 0 on a, rank 1 on b) saves steps 1..``last`` persisting every ``every``th;
    once a holds b's copy of step ``last``, b falls silent: "stopped" (SIGSTOPped: its port
    accepts, nothing answers) or "mute" (b gone, a listener on its port that accepts and never
    answers). One rank then restores through a's socket, the tier's request timeout at an hour.
    Returns its result and how often its log says b gave no answer."""
    root, a, b, urls = _setup(tmp_path)
    out = tmp_path / "out"
    mute = socket.socket()
    try:
        args = {"daemons": [a.socket_url, b.socket_url], "root": root, "last": last, "persist_every": every}
        _run(2, "save_memory", out, **args, hang=False)
        wait_for(lambda: _holds_copy_of(a, root, last, urls[1]), f"b's copy of step {last} on a", 120)
        if silence == "stopped":
            os.kill(b.proc.pid, signal.SIGSTOP)
        else:
            b.kill()
            mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mute.bind(("127.0.0.1", b.port))
            mute.listen(64)  # the kernel accepts each connection; nobody ever reads or answers
        env = {"CKPTD_TOKEN": TOKEN, "CKPTD_TIER_TIMEOUT_S": "3600"}
        args = {"daemon": a.socket_url, "root": root, "ref": str(out / f"ref_step{last}.pt")}
        procs = launch.spawn(1, "restore_position", args, out / "r1", env, scenarios=SCENARIOS)
        (res,) = launch.wait(procs, out / "r1", "restore_position", timeout=300)
        log = (out / "r1" / "restore_position.rank0.log").read_text()
        return res, log.count(f"the memory tier of {urls[1]} did not answer")
    finally:
        mute.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(b.proc.pid, signal.SIGCONT)
        a.kill()
        b.kill()


def _holds_copy_of(d: Daemon, root: str, step: int, source: str) -> bool:
    """Whether ``d`` holds ``source``'s copy of ``step``: a replica of its hot copy or its part."""
    status, body = d.get(f"/v1/tiers?root={root}", TOKEN)
    assert status == 200, body
    return any(c["step"] == step and c["source"] == source for c in body["replicas"] + body["memory_only"])  # type: ignore[index]


def test_a_silent_peer_is_left_out_of_the_restore(tmp_path):
    """A peer daemon that is SIGSTOPped is left out of the memory-only survey after
    ``CKPTD_TIER_SURVEY_S`` (0.8 s), whatever the tier's request timeout: with that timeout at an
    hour, the restore still ends, bitwise, from the own node's memory (its parts and its replicas
    of the silent node's), 0 bytes from the root."""
    res, silent = _restore_beside_a_silent_peer(tmp_path, "stopped", last=3, every=2)  # step 3: memory-only
    assert (res["step"], res["mismatches"], res["position"]) == (3, [], 3 * BATCH * 2), res
    assert res["tiers"]["root"] == 0 and res["tiers"]["local"] > 0, res["tiers"]
    assert silent == 1, silent


@pytest.mark.parametrize("silence", ["stopped", "mute"])
def test_a_silent_peer_is_asked_once_per_restore(tmp_path, silence):
    """A restore of a committed step from the tiers asks the peers twice (what they hold of any
    step, for the memory-only survey; then of the step chosen): a peer that gave no answer the
    first time is not waited for again in that restore, so it adds one survey window, not two.
    The step comes back bitwise from the own node's memory (its hot copy and its replica of the
    silent node's), 0 bytes from the root."""
    res, silent = _restore_beside_a_silent_peer(tmp_path, silence, last=2, every=2)  # step 2: committed
    assert (res["step"], res["mismatches"], res["position"]) == (2, [], 2 * BATCH * 2), res
    assert res["tiers"]["root"] == 0 and res["tiers"]["local"] > 0, res["tiers"]
    assert silent == 1, silent


def test_node_loss_during_a_save_restores_the_previous_whole_step(tmp_path):
    root, a, b, urls = _setup(tmp_path)
    out = tmp_path / "out"
    procs = []
    try:
        # Ranks 2 and 3 (node b) hang inside the hand-off of step 7: b never holds its part.
        args = {
            "daemons": [a.socket_url, b.socket_url],
            "root": root,
            "last": LAST,
            "persist_every": EVERY,
            "stall_rank_from": 2,
        }
        procs = launch.spawn(4, "save_memory", args, out, {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
        wait_for(
            lambda: all((out / f"saved_{r}").exists() for r in (2, 3)) and _has(a, root, LAST, {0, 1}, "self"),
            "step 7 held on node a, stalled on node b",
            600,
            procs,
            lambda: _logs(out, a, b),
        )
        wait_for(lambda: _has(a, root, LAST - 1, {2, 3}, urls[1]), "b's replicas of step 6 on a", 120)
        b.kill()
        kill_all(procs)

        # Step 7 lacks ranks 2 and 3 everywhere: step 6 is the newest whole step.
        res = _run(
            3, "restore_position", out / "r3", daemon=a.socket_url, root=root, ref=str(out / f"ref_step{LAST - 1}.pt")
        )
        got = _restored(res, LAST - 1)
        assert got["root"] == 0 and got["local"] > 0, got
        # The restore fenced the abandoned future: a holds nothing newer than step 6.
        assert max(p["step"] for p in _parts(a, root)) == LAST - 1

        # The routes need the token, the replica route a peer daemon's signature too; a pushed
        # part holds objects of its step's folder only, never a commit record.
        assert a.get(f"/v1/tiers?root={root}&keys=true", None)[0] == 401
        assert a.get(f"/v1/tiers?root={root}&keys=true", "wrong")[0] == 401
        # (One protocol: a part is pushed on the tier's replica route, kind memory_only.)
        part = {"root": root, "step": 9, "attempt": "x", "kind": "memory_only", "ranks": [0], "source": "http://evil"}
        for key in ("step_0000000008/arrays/a", "step_0000000009/../x", f"{mf.step_dir(9)}/{mf.COMMIT}"):
            body = part | {"objects": [{"key": key, "size": 1, "crc32c": 0}]}
            assert _post(a, "/v1/tiers/replicas", body) == 400, key
        assert _post(a, "/v1/tiers/replicas", part | {"objects": [], "ranks": [0, 1]}) == 400  # one rank's
        assert _post(a, "/v1/tiers/replicas", part | {"objects": [], "kind": "other"}) == 400
        assert _post(a, "/v1/tiers/replicas", part | {"objects": []}, token=None) == 401
        assert _post(a, "/v1/tiers/replicas", part | {"objects": []}, signed=False) == 403
    finally:
        kill_all(procs)
        for d in (a, b):
            d.kill()


def test_a_late_replica_and_a_newer_hand_off_keep_the_last_whole_step(tmp_path):
    """Retention keeps the newest step whole here until a newer one is: a 4-rank job (2 ranks per
    node, nothing persisted) saves steps 1..4; node b's push of step 3 to a is still in flight
    (b's daemon sleeps before it) when b dies, its ranks inside step 4's hand-off, and daemon a
    takes its own ranks' parts of step 4. The rule "keep the newest 2 steps per source" alone
    would have a drop its parts of step 2, the last step whole anywhere (a then holds its own
    parts of steps 3 and 4 and b's of 1 and 2) and the job would restart from scratch; a keeps
    them, and the restore at 3 ranks takes step 2 from a's memory, bitwise."""
    root, a, b, urls = _setup(tmp_path, push_delay=(3, 600))  # b is killed long before it ends
    out = tmp_path / "out"
    procs = []
    try:
        args = {
            "daemons": [a.socket_url, b.socket_url],
            "root": root,
            "last": 4,
            "persist_every": 100,
            "stall_rank_from": 2,
        }
        procs = launch.spawn(4, "save_memory", args | {"gate": True}, out, {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)

        def step2_whole_on_a_step3_held() -> bool:
            mine = [p for p in _parts(a, root) if p["step"] == 2 and p["source"] == "self"]
            pushed = len(mine) == 2 and all(p["replicated_to"] == {urls[1]: "complete"} for p in mine)
            return pushed and _has(a, root, 2, {2, 3}, urls[1]) and _has(b, root, 3, {2, 3}, "self")

        logs = lambda: launch.logs(out, "save_memory", 4) + a.logs() + b.logs()  # noqa: E731
        wait_for(step2_whole_on_a_step3_held, "step 2 whole on a, step 3 held on b", 300, procs, logs)
        assert not _has(a, root, 3, {2}, urls[1])  # b's replica of step 3 is in flight
        (out / "go").write_text("1")
        wait_for(lambda: all((out / f"saved_{r}").exists() for r in (2, 3)), "b's ranks in step 4", 120, procs, logs)
        b.kill()  # node b fails during step 4's save, its replica of step 3 still in flight
        wait_for(lambda: _has(a, root, 4, {0, 1}, "self"), "a's own parts of step 4", 120, logs=logs)
        kill_all(procs)  # the job's ranks go too

        res = _run(3, "restore_position", out / "r3", daemon=a.socket_url, root=root, ref=str(out / "ref_step2.pt"))
        got = _restored(res, 2)
        assert got["root"] == 0 and got["local"] > 0, got
    finally:
        kill_all(procs)
        a.kill()
        b.kill()


def test_a_memory_only_step_that_does_not_fit_is_persisted_instead(tmp_path):
    """A daemon whose staging budget holds the snapshots but not a memory-only copy of rank 0's
    6 MiB part: every rank persists the step instead (never half in memory, half in the root),
    with a log line and a metric; the steps are committed in the job root."""
    (tmp_path / "token").write_text(TOKEN)
    os.chmod(tmp_path / "token", 0o600)
    root = f"file://{tmp_path / 'job'}"
    d = Daemon(
        [root], tmp_path / "staging", tmp_path / "d.log", token_file=tmp_path / "token", CKPTD_BUDGET=str(9 << 20)
    )
    d.start()
    try:
        _run(
            2,
            "save_memory",
            tmp_path / "out",
            daemons=[d.socket_url],
            root=root,
            last=2,
            persist_every=EVERY,
            hang=False,
        )
        assert catalog.committed_steps(open_store(root)) == [1, 2]
        assert d.metric("ckptd_tier_persisted_instead_total", TOKEN) >= 2
        assert "is persisted to the job root instead" in d.logs()
        assert _parts(d, root) == []
    finally:
        d.kill()


def test_persist_every_needs_a_daemon(tmp_path):
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises(CheckpointError, match="persist_every"):
            Checkpointer(f"file://{tmp_path}", daemon="http://127.0.0.1:1", persist_every=bad)
    with pytest.raises(CheckpointError, match="persist_every"):
        Checkpointer(f"file://{tmp_path}", persist_every=2)  # memory-only steps live in daemons
