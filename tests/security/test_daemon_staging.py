"""Items 3-6 and the taken-port part of 12, against the real ``ckptd serve`` on loopback.

* 3: without ``--token-file`` the daemon refuses to start unless ``--insecure-no-auth`` is given,
  and then logs one WARNING saying so.
* 4: a staging folder pre-created by another local user (``leases`` a link to a folder outside)
  is refused; nothing outside is deleted. Links anywhere in the staging tree are never followed,
  not even by the startup recovery's deletes.
* 5: a staged metadata file swapped for a link to ``/proc/self/environ`` after validation never
  ends up in the checkpoint (before: the daemon uploaded its own environment, AWS keys included).
* 6: another local user cannot read staged weights (lease folders 0700).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from ckptd.server.safefiles import StagingError
from ckptd.server.staging import Staging
from storage_backends import open_store
from tests.security.conftest import as_user, assert_one_line_error, cli
from tests.server.daemon import Daemon, hand_off_body, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def shm_dir():
    """A folder other users can reach (``/dev/shm`` is world-writable and sticky, as in production)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    d = base / f"ckptd-sec-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _victim(tmp: Path) -> Path:
    v = tmp / "victim"
    (v / "precious").mkdir(parents=True)
    (v / "precious" / "data.txt").write_text("keep me")
    (v / "lease.json").write_text("{}")
    return v


# ------------------------------------------------------------------------------------ item 3


def test_serve_without_token_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTD_TOKEN_FILE")  # no token file at all, not even in the environment
    p = cli("serve", "--root", tmp_path / "jobs", "--port", "1", "--staging-dir", tmp_path / "stg", timeout=60)
    line = assert_one_line_error(p, rc=(2,))
    assert "--token-file" in line and "--insecure-no-auth" in line
    assert not (tmp_path / "stg").exists()  # refused before touching anything


def test_insecure_no_auth_logs_one_warning(tmp_path):
    # the mode under test: no token at all
    with Daemon([str(tmp_path / "jobs")], tmp_path / "stg", tmp_path / "d.log", insecure_no_auth=True) as d:
        assert d.get("/v1/status")[0] == 200
    warnings = [line for line in d.logs().splitlines() if " WARNING " in line and "INSECURE" in line]
    assert len(warnings) == 1, d.logs()


def test_taken_port_is_one_line_exit_1(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = cli(
            "serve",
            "--root",
            tmp_path / "j",
            "--port",
            port,
            "--token-file",
            os.environ["CKPTD_TOKEN_FILE"],
            "--staging-dir",
            tmp_path / "stg",
        )
    line = assert_one_line_error(p, rc=(1,))
    assert "address already in use" in line.lower()
    assert not (tmp_path / "stg").exists()


# ------------------------------------------------------------------------------------ item 4


def test_staging_precreated_by_another_user_is_refused(tmp_path, shm_dir, attacker):
    victim = _victim(tmp_path)
    staging = shm_dir / "ckptd"
    as_user(attacker, "mkdir", "-m", "0777", str(staging))
    as_user(attacker, "ln", "-s", str(victim), str(staging / "leases"))
    token = os.environ["CKPTD_TOKEN_FILE"]
    p = cli("serve", "--root", tmp_path / "jobs", "--token-file", token, "--staging-dir", staging, "--port", "0")
    line = assert_one_line_error(p, rc=(2,))
    assert f"uid {attacker.pw_uid}" in line
    assert (victim / "precious" / "data.txt").read_text() == "keep me"
    assert (victim / "lease.json").exists()


def test_links_in_own_staging_are_never_followed(tmp_path):
    victim = _victim(tmp_path)
    # `leases` itself a link: refused.
    (tmp_path / "a").mkdir(mode=0o700)
    os.symlink(victim, tmp_path / "a" / "leases")
    with pytest.raises(StagingError, match="symbolic link"):
        Staging(tmp_path / "a", budget=1 << 20)
    # The staging folder itself a link: refused.
    os.symlink(victim, tmp_path / "b")
    with pytest.raises(StagingError):
        Staging(tmp_path / "b", budget=1 << 20)
    # Links inside leases/ (to a folder, to a file): the startup recovery removes the links only.
    s = Staging(tmp_path / "c", budget=1 << 20)
    leases = tmp_path / "c" / "leases"
    os.symlink(victim, leases / "0123456789abcdef")
    os.symlink(victim / "precious", leases / "evil")
    real = leases / "fedcba9876543210"
    real.mkdir()
    os.symlink(victim / "lease.json", real / "lease.json")  # its journal a link: not read, folder removed
    os.symlink(victim / "precious", real / "sub")
    s.close()
    s = Staging(tmp_path / "c", budget=1 << 20)
    try:
        assert s.recover() == []
    finally:
        s.close()
    assert sorted(os.listdir(leases)) == []
    assert (victim / "precious" / "data.txt").read_text() == "keep me"
    assert (victim / "lease.json").exists()
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700


# ---------------------------------------------------------------------------------- item 5/6


def _lease(c: httpx.Client, root: str) -> dict:
    r = c.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 64, "client": "t"})
    assert r.status_code == 200, r.text
    return r.json()


def _job(lease: dict, root: str, step: int) -> dict:
    return hand_off_body(root, step, f"a{step}", lease["lease"], [{"key": "notes.json", "file": "m.bin"}])


def _stage(lease: dict) -> None:
    np.arange(4, dtype=np.float32).tofile(os.path.join(lease["dir"], "w.bin"))
    with open(os.path.join(lease["dir"], "m.bin"), "wb") as f:
        f.write(b'{"ok": 1}')


def test_metadata_swapped_for_environ_link_is_not_uploaded(tmp_path, shm_dir, attacker):
    root = str(tmp_path / "jobs")
    secret = f"AWS_SECRET_ACCESS_KEY_TEST_{uuid.uuid4().hex}"
    d = Daemon(
        [root],
        shm_dir / "ckptd",
        tmp_path / "d.log",
        CKPTD_UPLOAD_WORKERS="1",
        upload_delay_s=1.5,
        CKPTD_SECRET_FOR_TEST=secret,
    )
    with d, d.client() as c:
        first, second = _lease(c, root), _lease(c, root)
        # Item 6: the lease folder and what is staged in it are private to the daemon's user.
        for lease in (first, second):
            assert stat.S_IMODE(os.stat(lease["dir"]).st_mode) == 0o700
            _stage(lease)
        leaked = as_user(attacker, "cat", os.path.join(first["dir"], "w.bin"), check=False)
        assert leaked.returncode != 0 and leaked.stdout == ""
        # Item 5: job 1 holds the only upload worker (each put sleeps 1.5 s); job 2 waits in the
        # queue, validated, while its metadata file becomes a link to the daemon's environment.
        assert c.post("/v1/jobs", json=_job(first, root, 1)).status_code in (200, 202)
        r = c.post("/v1/jobs", json=_job(second, root, 2))
        assert r.status_code in (200, 202), r.text
        job2 = r.json()["job"]
        meta = os.path.join(second["dir"], "m.bin")
        os.unlink(meta)
        os.symlink("/proc/self/environ", meta)
        wait_for(lambda: c.get(f"/v1/jobs/{job2}").json()["state"] in ("failed", "committed"), "job 2", 60, logs=d.logs)
        assert c.get(f"/v1/jobs/{job2}").json()["state"] == "failed"
    with open_store(root) as store:
        for info in store.list(""):
            assert secret.encode() not in store.get(info.key), info.key


def test_staged_files_are_read_without_following_links(tmp_path):
    """The daemon-side reader itself: link, FIFO and size change are refused before any read."""
    from ckptd.server.safefiles import StagingFileError, read_staged

    (tmp_path / "ok").write_bytes(b"12345")
    assert read_staged(tmp_path / "ok", 5) == b"12345"
    os.symlink("/proc/self/environ", tmp_path / "link")
    with pytest.raises(OSError):
        read_staged(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StagingFileError):
        read_staged(tmp_path / "fifo")  # must not hang
    with pytest.raises(StagingFileError):
        read_staged(tmp_path / "ok", 4)


def test_client_never_writes_through_a_link_in_its_lease(tmp_path):
    """The trainer side: a link planted where the client writes a staged file (here the
    metadata file it rewrites at every save) is replaced, never written through."""
    from tests.security.conftest import small_state
    from trainer_hooks import Checkpointer

    root = str(tmp_path / "jobs")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    with Daemon([root], tmp_path / "stg", tmp_path / "d.log") as d:
        ckpt = Checkpointer(root, daemon=d.socket_url)
        try:
            ckpt.save(1, small_state(1)).result()
            staged = sorted((tmp_path / "stg" / "leases").glob("*/meta_*.bin"))
            assert staged, "the client staged no metadata file"
            for f in (tmp_path / "stg" / "leases").glob("*/*.bin"):
                assert stat.S_IMODE(f.stat().st_mode) & 0o007 == 0, f  # nothing for other users
            for f in staged:
                f.unlink()
                os.symlink(victim, f)
            ckpt.save(2, small_state(2)).result()
        finally:
            ckpt.close()
    assert victim.read_text() == "keep me"
