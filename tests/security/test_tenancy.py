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

import contextlib
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from tests.security.conftest import REPO, env
from tests.server.daemon import Daemon, hand_off_body, wait_for

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


def tenant_tree(tag: str, tenants) -> tuple[Path, Path, Path, dict[str, Path], dict[str, Path]]:
    """A node's folders in /dev/shm: (base, the token (0640, the staging group's), ``jobs/`` (the
    daemon's), each tenant's job root under it and working folder (theirs, 0755))."""
    base = Path("/dev/shm") / f"ckptd-{tag}-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    token = base / "token"
    token.write_text(TOKEN + "\n")
    os.chown(token, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(token, 0o640)
    jobs = base / "jobs"
    jobs.mkdir(mode=0o755)
    roots, works = {}, {}
    for name, pw in tenants.items():
        for d, where in ((jobs / name, roots), (base / f"work-{name}", works)):
            d.mkdir(mode=0o755)
            os.chown(d, pw.pw_uid, pw.pw_gid)
            where[name] = d
    return base, token, jobs, roots, works


@pytest.fixture
def node(tenants, request):
    """A node: the daemon (root) serving ``jobs/``; alice's and bob's job roots (theirs, 0755),
    their working folders, the token (0640, the staging group's)."""
    isolate = getattr(request, "param", "isolated") == "isolated"
    base, token, jobs, roots, works = tenant_tree("ten", tenants)
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
            yield {
                "daemon": daemon,
                "addr": addr,
                "roots": roots,
                "tenant": tenant,
                "users": tenants,
                "isolated": isolate,
            }
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
    logs = node["daemon"].log_path.read_text()
    warned = [line for line in logs.splitlines() if "not isolated from each other" in line]
    assert len(warned) == (0 if node["isolated"] else 1), logs


# ------------------------------------------------------------------------------------- (b)


def test_bob_cannot_read_alices_staged_weights(node):
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    lease = alice(op="lease")
    bob = node["tenant"](BOB)
    # bob asks the daemon for the jobs, on every address it has
    seen = []
    unix = node["addr"][len("unix://") :]
    for addr in {node["addr"], "http+unix://" + unix.replace("/", "%2F"), node["daemon"].url}:
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


# ------------------------------------------------------------------------ owners, operators


def _operator(node) -> httpx.Client:
    """root on the daemon's socket: an operator (sees and may do everything)."""
    sock = node["addr"][len("unix://") :]
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=sock),
        base_url="http://ckptd",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )


def test_a_lease_and_its_jobs_are_its_owners_only(node):
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    lease = alice(op="lease")["lease"]
    with _operator(node) as op:
        jobs = op.get("/v1/jobs").json()
    job = next(j for j in jobs if j["lease"] == lease)
    assert job["uid"] == node["users"][ALICE].pw_uid
    bob = node["tenant"](BOB)

    def call(method, path, body=None, addr=node["addr"]):
        return bob(op="http", daemon=addr, method=method, path=path, body=body)["status"]

    for path in ("acquire", "heartbeat"):
        assert call("POST", f"/v1/leases/{lease}/{path}") == 403, path
    assert call("POST", f"/v1/leases/{lease}/grow", {"bytes": 1}) == 403
    assert call("DELETE", f"/v1/leases/{lease}") == 403
    handoff = {
        "lease": lease,
        "root": str(node["roots"][BOB]),
        "step": 5,
        "attempt": "bob",
        "rank": 0,
        "world_size": 1,
        "shards": [],
    }
    assert call("POST", "/v1/jobs", handoff) == 403
    assert call("GET", f"/v1/jobs/{job['job']}") == 404
    # over TCP (not trusted): no leases, no hand-offs, no jobs shown
    tcp = node["daemon"].url
    new = {"root": str(node["roots"][BOB]), "rank": 0, "bytes": 1, "client": "b"}
    assert call("POST", "/v1/leases", new, tcp) == 403
    assert call("POST", f"/v1/leases/{lease}/heartbeat", addr=tcp) == 403
    r = bob(op="http", daemon=tcp, method="GET", path="/v1/jobs")
    assert r["status"] == 200 and r["body"] == {"items": []}, r
    # nor listings or verifies of her root, on either address
    for addr in (node["addr"], tcp):
        assert call("GET", f"/v1/checkpoints?root={root}", addr=addr) == 403
        assert call("POST", f"/v1/page/verify?root={root}&step=1", addr=addr) == 403
    # her lease still works for her
    assert alice(op="save", step=2, seed=2) == {"ok": True}
    assert alice(op="restore", root=root) == {"step": 2, "digest": _expected(2)}


def test_an_operator_binds_a_root(node):
    # The node's daemon has no --bind: restart it with one (same staging, same port).
    d = node["daemon"]
    shared = d.roots[0] + "/shared"
    os.mkdir(shared, 0o755)  # root's: neither alice nor bob can write it
    d.stop()
    d.env["CKPTD_BINDS"] = json.dumps([f"{shared}={ALICE}"])
    d.start(port=d.port)
    alice, bob = node["tenant"](ALICE), node["tenant"](BOB)
    assert alice(op="open", root=shared, daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    assert bob(op="open", root=shared + "/inner", daemon=node["addr"]) == {"ok": True}
    r = bob(op="save", step=2, seed=666)
    assert "403" in r.get("error", ""), r
    assert alice(op="restore", root=shared) == {"step": 1, "digest": _expected(1)}
    with _operator(node) as op:  # root reads any root
        assert op.get("/v1/checkpoints", params={"root": shared}).status_code == 200


def test_a_restarted_daemon_resumes_a_tenants_hand_off(node):
    d = node["daemon"]
    d.stop()
    d.upload_delay_s = 2
    d.start(port=d.port)
    alice, root = node["tenant"](ALICE), str(node["roots"][ALICE])
    assert alice(op="open", root=root, daemon=node["addr"]) == {"ok": True}
    # the save's reply comes once it is committed: send it, kill the daemon mid-upload
    alice.proc.stdin.write(json.dumps({"op": "save", "step": 1, "seed": 1}) + "\n")
    alice.proc.stdin.flush()

    def uploading():
        with contextlib.suppress(httpx.HTTPError), _operator(node) as op:
            return any(j["state"] == "uploading" for j in op.get("/v1/jobs").json())
        return False

    wait_for(uploading, "alice's upload", 120, logs=d.logs)
    d.kill()
    d.upload_delay_s = 0
    d.start(port=d.port)
    assert json.loads(alice.proc.stdout.readline()) == {"ok": True}, d.logs()
    assert "resuming job" in d.logs()
    assert alice(op="restore", root=root) == {"step": 1, "digest": _expected(1)}
    assert alice(op="save", step=2, seed=2) == {"ok": True}
    assert alice(op="restore", root=root) == {"step": 2, "digest": _expected(2)}


def test_a_staged_file_of_another_user_is_refused(tmp_path, tenants):
    """Group mode's second line of defence: a file in the lease not owned by its uid (as a
    rename by another member would leave, were the sticky bit gone) fails the hand-off."""
    from ckptd.server.handoff import BadJob, validate
    from ckptd.server.roots import Roots
    from ckptd.server.staging import Staging

    alice, bob = tenants[ALICE], tenants[BOB]
    s = Staging(tmp_path / "stg", 1 << 20, group=grp.getgrnam(GROUP).gr_gid)
    try:
        lease = s.create(str(tmp_path / "jobs"), 0, 64, 64, "t", uid=alice.pw_uid, gid=alice.pw_gid)
        assert stat.S_IMODE(os.stat(lease.dir).st_mode) == 0o3770
        f = lease.dir / "w.bin"
        f.write_bytes(b"\0" * 16)
        os.chown(f, bob.pw_uid, bob.pw_gid)
        req = hand_off_body(str(tmp_path / "jobs"), 1, "a")
        with pytest.raises(BadJob, match=f"belongs to uid {bob.pw_uid}"):
            validate(req, lease, Roots([str(tmp_path / "jobs")]))
        os.chown(f, alice.pw_uid, alice.pw_gid)
        assert validate(req, lease, Roots([str(tmp_path / "jobs")])).uid == alice.pw_uid
    finally:
        s.close()


def test_the_first_writer_binds_a_shared_root_across_restarts(node):
    """A root both tenants may write (their group's, 2775): the first to hand off owns it; the
    binding outlives a daemon restart."""
    d = node["daemon"]
    common = Path(d.roots[0]) / "common"
    common.mkdir()
    os.chown(common, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(common, 0o2775)
    alice, bob = node["tenant"](ALICE), node["tenant"](BOB)
    assert alice(op="open", root=str(common), daemon=node["addr"]) == {"ok": True}
    assert alice(op="save", step=1, seed=1) == {"ok": True}
    for restart in (False, True):
        if restart:
            d.kill()
            d.start(port=d.port)
        assert bob(op="open", root=str(common), daemon=node["addr"]) == {"ok": True}
        r = bob(op="save", step=2 + restart, seed=666)
        assert "403" in r.get("error", ""), (restart, r)
    assert alice(op="save", step=5, seed=5) == {"ok": True}  # and still hers
    assert alice(op="restore", root=str(common)) == {"step": 5, "digest": _expected(5)}


def test_bad_bindings_stop_the_daemon_with_one_line(tmp_path):
    from tests.security.conftest import assert_one_line_error, cli

    staging = tmp_path / "stg"
    token = os.environ["CKPTD_TOKEN_FILE"]
    base = ["serve", "--root", tmp_path / "jobs", "--token-file", token, "--port", "0", "--staging-dir", staging]
    line = assert_one_line_error(cli(*base, "--bind", "no-user-here"), rc=(2,))
    assert "ROOT=USER" in line
    line = assert_one_line_error(cli(*base, "--bind", f"{tmp_path}/jobs=no-such-user-xyz"), rc=(2,))
    assert "no such user" in line
    staging.mkdir(mode=0o700, exist_ok=True)
    (staging / "bindings.json").write_text('{"roots": [{"uid": "alice"}]}')
    line = assert_one_line_error(cli(*base), rc=(2,))
    assert "bindings" in line and "malformed" in line


def test_a_staging_path_longer_than_a_socket_address_still_serves_its_socket(tmp_path):
    """Unix socket addresses hold 107 bytes; the daemon and the client reach a longer path
    through a descriptor of its folder."""
    from trainer_hooks import Checkpointer

    staging = tmp_path / ("s" * 100) / "staging"
    staging.parent.mkdir()
    root = str(tmp_path / "jobs")
    with Daemon([root], staging, tmp_path / "d.log") as d:
        assert len(d.socket_url) > 120
        with Checkpointer(root, daemon=d.socket_url) as ckpt:
            ckpt.save(1, {"w": torch.ones(4)}).result()
        assert Path(root, "step_0000000001", "commit.json").exists()


# ------------------------------------------------------------------- committed files, on disk


def _cli_as(user: pwd.struct_passwd, *argv: str) -> subprocess.CompletedProcess:
    """``ckptd ARGV`` run as ``user`` (``cli_as.py``)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.security.cli_as", user.pw_name, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
        env=env(),
    )


def _tree(root: Path) -> list[Path]:
    """Every file and folder below ``root`` (walked as root, links not followed)."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        out += [Path(dirpath) / n for n in dirs + files]
    return out


def retire_as(tenant, user: pwd.struct_passwd, root: Path) -> None:
    """``user``'s own ``gc --keep-last 2`` and ``quarantine --step 4`` on ``root``'s steps 1-4
    (committed through the daemon) succeed as that user; the restore then takes step 3."""
    p = _cli_as(user, "gc", str(root), "--keep-last", "2")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert not (root / "step_0000000001").exists() and not (root / "step_0000000002").exists()
    p = _cli_as(user, "quarantine", str(root), "--step", "4", "--reason", "test")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert tenant(op="restore", root=str(root)) == {"step": 3, "digest": _expected(3)}


def _reads(user: pwd.struct_passwd, f: Path) -> bool:
    return run_as(user, "sh", "-c", 'cat -- "$1" >/dev/null', "sh", str(f)).returncode == 0


def test_committed_files_belong_to_their_tenant(node):
    """What the daemon (root) commits into alice's root is hers, with no world bits: bob cannot
    read a byte of it, through ``ckptd show`` or ``cat``; alice reads it, and her own ``ckptd
    gc`` and ``ckptd quarantine`` (run as her, not root) retire her steps."""
    users, root = node["users"], Path(node["roots"][ALICE])
    alice_pw, bob_pw = users[ALICE], users[BOB]
    alice = node["tenant"](ALICE)
    assert alice(op="open", root=str(root), daemon=node["addr"]) == {"ok": True}
    for step in (1, 2, 3, 4):
        assert alice(op="save", step=step, seed=step) == {"ok": True}
    made = _tree(root)
    files = [p for p in made if p.is_file()]
    assert files and any(p.name == "zarr.json" for p in files), made
    # bob: no command of his reads her weights
    p = _cli_as(bob_pw, "show", str(root))
    assert p.returncode != 0 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    read = [str(f) for f in files if _reads(bob_pw, f)]
    assert not read, f"bob read alice's committed files: {read[:5]}"
    gid = root.stat().st_gid
    wrong = [
        (str(p), st.st_uid, st.st_gid, oct(stat.S_IMODE(st.st_mode)))
        for p in made
        if (st := p.lstat()).st_uid != alice_pw.pw_uid or st.st_gid != gid or st.st_mode & 0o007
    ]
    assert not wrong, wrong
    # alice: reads everything, and retires her own steps as herself
    assert all(_reads(alice_pw, f) for f in files)
    p = _cli_as(alice_pw, "show", str(root))
    assert p.returncode == 0, p.stderr
    retire_as(alice, alice_pw, root)
    # and her next save through the daemon is hers too (what her own commands made is as her
    # umask made it)
    assert alice(op="save", step=5, seed=5) == {"ok": True}
    step5 = root / "step_0000000005"
    wrong = [str(p) for p in [step5, *_tree(step5)] if p.lstat().st_uid != alice_pw.pw_uid or p.lstat().st_mode & 0o007]
    assert not wrong, wrong
