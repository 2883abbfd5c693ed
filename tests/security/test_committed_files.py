"""Issue 36 item 5: committed files belong to their tenant, also where the daemon cannot give
them away. ``test_tenancy.py::test_committed_files_belong_to_their_tenant`` covers a daemon with
``CAP_CHOWN`` (the files are alice's); here:

* a daemon without ``CAP_CHOWN`` or ``CAP_DAC_OVERRIDE`` (a service user outside the systemd
  unit's capabilities) that writes alice's root through its group: before, it committed 0644
  files in 2755 folders, so bob read her weights and her own ``ckptd gc`` (run as her) could not
  delete a step;
* a root folder every local user can write, or one that another user owns, is never bound:
  before, the daemon committed alice's steps into both.

The daemon is the real ``ckptd serve`` of ``tests/server/daemon.py``, started as root with every
capability gone (empty bounding set, ``SECBIT_NOROOT``) and the groups a service user would have:
the staging group and alice's root's group. (A real non-root uid cannot start this machine's
Python, which lives under ``/root``.) Alice and bob are the real users of ``test_tenancy.py``.
"""

from __future__ import annotations

import ctypes
import grp
import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.security.test_tenancy import (
    ALICE,
    BOB,
    GROUP,
    Tenant,
    _cli_as,
    _reads,
    _tree,
    retire_as,
    tenant_tree,
)
from tests.security.test_tenancy import node as node  # the fixtures
from tests.security.test_tenancy import tenants as tenants
from tests.server.daemon import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _SECBIT_NOROOT_AND_LOCK = 24, 28, 0b11


def _no_capabilities(groups: list[int]):
    """A ``preexec_fn``: these supplementary groups, then no capability now or after exec."""

    def drop() -> None:
        os.setgroups(groups)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT_AND_LOCK, 0, 0, 0) == 0
        for cap in range(64):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # past the last capability this kernel knows

    return drop


def _cap_eff(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def test_a_daemon_without_cap_chown_commits_with_the_roots_group_and_no_world_bits(tenants):
    alice_pw, bob_pw = tenants[ALICE], tenants[BOB]
    base, token, jobs, roots, works = tenant_tree("grp", tenants)
    root = roots[ALICE]
    # alice's root, shared with the daemon through her group (setgid: what is made there gets it)
    os.chown(root, alice_pw.pw_uid, alice_pw.pw_gid)
    os.chmod(root, 0o2775)
    daemon = Daemon(
        [str(jobs)],
        base / "staging",
        base / "daemon.log",
        token_file=token,
        preexec_fn=_no_capabilities([grp.getgrnam(GROUP).gr_gid, alice_pw.pw_gid]),
        CKPTD_STAGING_GROUP=GROUP,
    )
    alice = None
    try:
        with daemon:
            assert _cap_eff(daemon.proc.pid) == 0
            alice = Tenant(alice_pw, works[ALICE], token)
            assert alice(op="open", root=str(root), daemon=daemon.socket_url) == {"ok": True}
            for step in (1, 2, 3, 4):
                assert alice(op="save", step=step, seed=step) == {"ok": True}
            made = _tree(root)
            files = [p for p in made if p.is_file()]
            assert any(p.name == "zarr.json" for p in files), made
            wrong = [
                (str(p), st.st_gid, oct(stat.S_IMODE(st.st_mode)))
                for p in made
                if (st := p.lstat()).st_gid != alice_pw.pw_gid
                or st.st_mode & 0o007
                or stat.S_IMODE(st.st_mode) != (0o2770 if p.is_dir() else 0o640)
            ]
            assert not wrong, wrong
            # bob: no command of his reads her weights, and he is told why in one line
            p = _cli_as(bob_pw, "show", str(root))
            assert p.returncode != 0 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
            assert "ermission denied" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
            read = [str(f) for f in files if _reads(bob_pw, f)]
            assert not read, f"bob read alice's committed files: {read[:5]}"
            # alice: her own gc and quarantine (as her, not root) retire the daemon's files
            retire_as(alice, alice_pw, root)
    finally:
        if alice is not None:
            alice.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("kind", ["world-writable", "bobs"])
def test_a_root_others_can_write_is_never_bound(node, kind):
    """A root folder every local user can write (bob plants or swaps her steps), or bob's own
    folder that alice may write through a group (bob reads and replaces what lands there): the
    daemon refuses to commit alice's step there, 403 with the reason."""
    users = node["users"]
    root = Path(node["daemon"].roots[0]) / f"root-{kind}"
    root.mkdir()
    if kind == "world-writable":
        os.chown(root, users[ALICE].pw_uid, users[ALICE].pw_gid)
        os.chmod(root, 0o777)
        why = "writable by every local user"
    else:
        os.chown(root, users[BOB].pw_uid, grp.getgrnam(GROUP).gr_gid)
        os.chmod(root, 0o775)
        why = f"belongs to uid {users[BOB].pw_uid}"
    alice = node["tenant"](ALICE)
    assert alice(op="open", root=str(root), daemon=node["addr"]) == {"ok": True}
    r = alice(op="save", step=1, seed=1)
    assert "403" in r.get("error", "") and why in r["error"], r
    assert not any(p.name.startswith("step_") for p in root.iterdir())
