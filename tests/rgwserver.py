"""A real Ceph RADOS Gateway on loopback for tests: a one-node Ceph cluster, vstart-style.

One monitor (``ceph-mon``), one OSD on ``memstore`` (objects in the OSD's memory), and
``radosgw`` with the beast frontend on a free 127.0.0.1 port, plus one S3 user made with
``radosgw-admin``. Everything lives in a temporary folder (config, monitor store, logs, admin
sockets); the three daemons run in the foreground (``-f``) as our children and are stopped by
pid. Debian 12's packages ``radosgw ceph-mon ceph-osd`` (Ceph 16.2 Pacific) provide the binaries;
``.ci/run`` installs them where missing. ``tests/conftest.py`` wraps this in the ``rgw_server``
and ``rgw_bucket`` fixtures.

Bootstrap order and config keys follow Ceph's ``src/vstart.sh``: monmap and ``ceph-mon --mkfs``,
``ceph osd new`` then ``ceph-osd --mkfs``, then the gateway, which creates its own pools. Cephx is
off (``auth * required = none``): the cluster only listens on loopback for one test session.
RGW asks for a "secure" monitor connection by default, which needs cephx session keys, so it is
told to accept "crc" (``ms_mon_client_mode``); without that it retries authentication (-13) until
its 300 s timeout. Pools are one replica (``osd pool default size = 1`` with ``mon allow pool size
one``) and 8 placement groups, so a single OSD serves them all at once.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests import load
from tests.load import scaled
from tests.local_launch import free_port
from tests.s3server import answers, terminate

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
ACCESS_KEY = "ckptd-test-access"
SECRET_KEY = "ckptd-test-secret"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def missing_binaries() -> list[str]:
    """The Ceph programs not on PATH (empty when the cluster can be started)."""
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class RGWServer:
    """A running cluster: ``url`` is the S3 endpoint; ``procs`` the daemons, in start order."""

    root: Path
    url: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    def log_tail(self, chars: int = 3000) -> str:
        """The end of every daemon's log, for a failure message."""
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace")
            out.append(f"--- {log.name}\n{text[-chars:]}")
        return "\n".join(out)


_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
osd crush chooseleaf type = 0
mon data avail warn = 1
mon data avail crit = 1
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
log to stderr = false
err to stderr = false
[mon]
mon data = {root}/mon
[osd]
osd data = {root}/osd
osd objectstore = memstore
memstore device bytes = {device_bytes}
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {root}/rgw
ms mon client mode = crc
"""


def _transient(result: subprocess.CompletedProcess | BaseException) -> bool:
    """A Ceph client's passing failure on a loaded machine: EAGAIN (errno 11, "Resource
    temporarily unavailable") or a timed-out connection to the monitor."""
    if isinstance(result, subprocess.TimeoutExpired):
        return True
    if isinstance(result, BaseException) or result.returncode == 0:
        return False
    text = result.stderr.lower()
    return result.returncode == 11 or any(
        s in text for s in ("resource temporarily unavailable", "eagain", "(11)", "timed out", "error connecting")
    )


def _run(server: RGWServer, *args: str, timeout: float = 60) -> str:
    """A Ceph command-line tool against this cluster; raises with its output and the logs. The
    cluster's own clients (``ceph``, ``radosgw-admin``: idempotent here) are retried on a
    transient failure (``_transient``); ``--mkfs`` runs are not."""
    cmd = [args[0], "-c", str(server.conf), *args[1:]]

    def once() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(timeout), stdin=subprocess.DEVNULL)

    try:
        retried = args[0] in ("ceph", "radosgw-admin")
        r = load.retry(once, _transient, " ".join(args[:3])) if retried else once()
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(
            f"{' '.join(cmd)} timed out after {e.timeout:.0f}s\n{load.tail(e.stderr)}\n{server.log_tail()}"
        ) from e
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}\n{server.log_tail()}")
    return r.stdout


def _daemon(server: RGWServer, name: str, *args: str) -> None:
    out = open(server.root / "log" / f"{name}.stdout.log", "wb")  # noqa: SIM115
    with out:
        server.procs[name] = subprocess.Popen(
            [args[0], "-f", "-c", str(server.conf), *args[1:]],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_rgw_server(timeout: float = 120.0, device_bytes: int = 1 << 30) -> RGWServer:
    """Bootstrap the cluster and return it once its S3 endpoint answers; on failure stop what
    was started and raise with the daemons' log tails. Usually 10-20 s. ``device_bytes``: the
    memstore OSD's size (its memory); past it the OSD is full and writes wait forever, and
    RGW frees deleted objects' space only at its garbage collection (hours), so size it for
    every byte a run writes."""
    root = Path(tempfile.mkdtemp(prefix="ckptd-rgw-"))
    server = RGWServer(root)
    try:
        _bootstrap(server, timeout, device_bytes)
    except BaseException:
        stop(server, keep_logs=True)
        raise
    return server


def _bootstrap(server: RGWServer, timeout: float, device_bytes: int) -> None:
    root = server.root
    for sub in ("mon", "osd", "rgw", "run", "log"):
        (root / sub).mkdir()
    fsid = str(uuid.uuid4())
    mon_port, rgw_port = free_port(), free_port()
    server.conf.write_text(
        _CONF.format(fsid=fsid, root=root, mon_port=mon_port, rgw_port=rgw_port, device_bytes=device_bytes)
    )
    monmap = str(root / "monmap")
    subprocess.run(
        ["monmaptool", "--create", "--clobber", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", monmap],
        check=True,
        capture_output=True,
    )
    _run(server, "ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
    _daemon(server, "mon", "ceph-mon", "-i", "a")
    osd_uuid = str(uuid.uuid4())
    osd_id = _run(server, "ceph", "--connect-timeout", str(int(scaled(30))), "osd", "new", osd_uuid).strip()
    _run(server, "ceph-osd", "--mkfs", "-i", osd_id, "--osd-uuid", osd_uuid)
    _daemon(server, "osd", "ceph-osd", "-i", osd_id)
    _daemon(server, "rgw", "radosgw", "-n", "client.rgw")
    url = f"http://127.0.0.1:{rgw_port}"
    deadline = load.deadline(timeout)  # idle: 10-20 s
    while not answers(url + "/"):
        dead = [n for n, p in server.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"no answer after {scaled(timeout):.0f}s"
            raise RuntimeError(f"RGW did not start on {url}: {why}\n{server.log_tail()}")
        time.sleep(0.2)
    _run(
        server,
        "radosgw-admin",
        "user",
        "create",
        "--uid=ckptd",
        "--display-name=ckptd tests",
        f"--access-key={ACCESS_KEY}",
        f"--secret-key={SECRET_KEY}",
    )
    server.url = url


def stop(server: RGWServer, keep_logs: bool = False) -> None:
    """Stop the daemons by pid, gateway first (SIGTERM, then SIGKILL), and remove the folder
    (memstore keeps the objects in the OSD's memory, so nothing else is left)."""
    for proc in reversed(list(server.procs.values())):
        terminate(proc)
    if not keep_logs:
        with contextlib.suppress(OSError):
            shutil.rmtree(server.root)
