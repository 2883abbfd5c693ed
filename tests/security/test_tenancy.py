"""Issue 26 part 2: two tenants of one node, alice and bob, real local users training two jobs
through one real ``ckptd serve`` (run as root, as a daemon with ``CAP_CHOWN`` and
``CAP_DAC_OVERRIDE`` is), both in the staging group and given the token, as
``deploy/README.md`` says. Their trainers are real processes of those users
(``tests/security/tenant.py``); bob's file tricks are coreutils run as bob.

* (a) bob renames same-size files over alice's staged shard files while her lease is idle
  between saves: before, her next save committed bob's values;
* (b) bob finds her lease in ``GET /v1/jobs`` and reads her staged files: before, he could;
* (c) bob hands off into alice's job root (which he cannot write): before, the daemon committed
  his step 9999999999 there and her ``restore()`` loaded his values.

(a) runs in both staging modes: per-tenant folders (the daemon can chown: isolated) and the
group mode of a daemon without those capabilities (``CKPTD_ISOLATE_TENANTS=0``).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.security.conftest import REPO, env
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUP = "ckptd-tenants"
ALICE, BOB = "ckptd-alice", "ckptd-bob"
TOKEN = "tenant-token-0123456789"
FORGED_STEP = 9_999_999_999


@pytest.fixture(scope="session")
def tenants() -> dict[str, pwd.struct_passwd]:
    """alice and bob, both in the staging group (created once; needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create local users")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    out = {}
    for name in (ALICE, BOB):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", GROUP, name], check=True
            )
        out[name] = pwd.getpwnam(name)
    return out


def run_as(user: pwd.struct_passwd, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` as ``user`` with the user's groups (setpriv --init-groups)."""
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--", *cmd],
        capture_output=True,
        text=True,
        timeout=60,
    )


class Tenant:
    """A trainer process of one user (``tenant.py``), driven one command at a time."""

    def __init__(self, user: pwd.struct_passwd, work: Path, token: Path):
        self.user = user
        self._err = open(work / "stderr.log", "a")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.security.tenant", user.pw_name, str(work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=str(REPO),
            env={**env(), "CKPTD_TOKEN_FILE": str(token), "OMP_NUM_THREADS": "1"},
        )

    def __call__(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"{self.user.pw_name}'s trainer exited ({self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self._err.close()


@pytest.fixture
def node(tenants, request):
    """A node: the daemon (root) serving ``jobs/``; alice's and bob's job roots (theirs, 0755),
    their working folders, the token (0640, the staging group's)."""
    isolate = getattr(request, "param", "isolated") == "isolated"
    base = Path("/dev/shm") / f"ckptd-ten-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    gid = grp.getgrnam(GROUP).gr_gid
    token = base / "token"
    token.write_text(TOKEN + "\n")
    os.chown(token, 0, gid)
    os.chmod(token, 0o640)
    jobs = base / "jobs"
    jobs.mkdir(mode=0o755)
    roots, works = {}, {}
    for name, pw in tenants.items():
        for d, where in ((jobs / name, roots), (base / f"work-{name}", works)):
            d.mkdir(mode=0o755)
            os.chown(d, pw.pw_uid, pw.pw_gid)
            where[name] = d
    daemon = Daemon(
        [str(jobs)],
        base / "staging",
        base / "daemon.log",
        token_file=token,
        trust_tcp=False,
        CKPTD_STAGING_GROUP=GROUP,
        **({} if isolate else {"CKPTD_ISOLATE_TENANTS": "0"}),
    )
    started: list[Tenant] = []

    def tenant(name: str) -> Tenant:
        t = Tenant(tenants[name], works[name], token)
        started.append(t)
        return t

    with daemon:
        # The trainers' address: the daemon's Unix socket where it has one, else its port.
        sock = Path(daemon.socket_url[len("unix://") :])
        addr = daemon.socket_url if sock.exists() else daemon.url
        try:
            yield {"daemon": daemon, "addr": addr, "roots": roots, "tenant": tenant, "users": tenants}
        finally:
            for t in started:
                t.close()
    shutil.rmtree(base, ignore_errors=True)


def _expected(seed: int) -> str:
    from tests.security.tenant import digest, state

    return digest(state(seed))


def _staged_shards(lease_dir: str) -> list[Path]:
    return sorted(p for p in Path(lease_dir).iterdir() if p.name[0].isdigit() and p.name.endswith(".bin"))


# ------------------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("node", ["isolated", "group"], indirect=True)
def test_bob_cannot_swap_alices_staged_weights(node):
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    lease = alice(op="lease")
    shards = _staged_shards(lease["dir"])
    assert shards, "alice staged no shard file"
    # Between her saves (her lease idle, handed back to her), bob renames same-size files of
    # his over her staged shard files. He is told where they are: secrecy of the lease id is
    # not what protects her.
    bob = node["users"][BOB]
    swapped = []
    for f in shards:
        size = f.stat().st_size
        tmp = f.parent / f".bob-{f.name}"
        p = run_as(bob, "sh", "-c", f"truncate -s {size} '{tmp}' && mv -f '{tmp}' '{f}'")
        swapped.append(p.returncode == 0)
    # Her next save commits her values (or fails); never his.
    saved = alice(op="save", step=2, seed=2)
    got = alice(op="restore", root=root)
    assert got["digest"] == _expected(got["step"]), (swapped, saved, got, node["daemon"].logs())
    assert got["step"] == 2, (swapped, saved, got)
    assert not any(swapped), "bob could rename a file over alice's staged shard"


# ------------------------------------------------------------------------------------- (b)


def test_bob_cannot_read_alices_staged_weights(node):
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    lease = alice(op="lease")
    bob = node["tenant"](BOB)
    # bob asks the daemon for the jobs, on every address it has
    seen = []
    for addr in {node["addr"], node["daemon"].url}:
        r = bob(op="http", daemon=addr, method="GET", path="/v1/jobs")
        seen.append(json.dumps(r))
    assert not any(lease["lease"] in s for s in seen), seen
    # and, told where her files are all the same, cannot read them
    shards = _staged_shards(lease["dir"])
    assert shards
    p = run_as(node["users"][BOB], "cat", str(shards[0]))
    assert p.returncode != 0 and p.stdout == "", "bob read alice's staged weights"
    p = run_as(node["users"][BOB], "ls", lease["dir"])
    assert p.returncode != 0, "bob listed alice's lease folder"


# ------------------------------------------------------------------------------------- (c)


@pytest.mark.parametrize("alice_via", ["daemon", "in-process"])
def test_bob_cannot_hand_off_into_alices_root(node, alice_via):
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"] if alice_via == "daemon" else None) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    bob = node["tenant"](BOB)
    # bob cannot write her root himself
    assert run_as(node["users"][BOB], "touch", f"{root}/bob-was-here").returncode != 0
    # a stock trainer of bob's, pointed at her root, through the daemon (every address it has)
    for addr in dict.fromkeys([node["addr"], node["daemon"].url]):
        assert bob(op="open", root=root, daemon=addr) == {"ok": True}
        r = bob(op="save", step=FORGED_STEP, seed=666)
        assert "error" in r, f"the daemon accepted bob's hand-off into alice's root via {addr}"
        assert "403" in r["error"], r
    assert not (Path(root) / f"step_{FORGED_STEP:010d}").exists()
    got = alice(op="restore", root=root)
    assert got == {"step": 1, "digest": _expected(1)}, got
