"""A real ``ckptd serve`` process on a free loopback port, for tests; and the launcher for the
trainer scenarios of this folder (``daemon_scenarios.py``, run by ``tests/distributed/worker.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.distributed import launch
from tests.load import deadline as load_deadline
from tests.load import scaled

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = "tests.server.daemon_scenarios"


class Daemon:
    """``ckptd serve`` in a subprocess, as the docs run it: ``--token-file`` (``token_file``, else
    the file ``CKPTD_TOKEN_FILE`` names, which tests/conftest.py gives every test, so its trainers
    read the same token as the docs' job script does), its own Unix socket (``socket_url``: leases
    and hand-offs go there), no ``--trust-tcp``. ``env`` adds ``CKPTD_*`` settings. Stopped by its
    pid, never by name. ``trust_tcp=True`` (``--trust-tcp``) and ``insecure_no_auth=True`` (no
    token) are for the tests of those modes only (tests/unit/test_documented_config.py lists
    them). Faults, read at each ``start``: ``upload_delay_s``,
    each shard put into a job root sleeps that long first (a test kills the daemon mid-upload);
    ``tier_delay_s``, each read of its memory tier sleeps first (a slow peer); ``push_delay``
    (step, seconds), each push of that step's copies to a peer sleeps first (a replica in
    flight); ``no_backpressure``, memory-only hand-offs never wait for older steps' replicas (a
    baseline). Any of them runs the daemon through ``tests.doubles.slow_serve``."""

    def __init__(
        self,
        roots: list[str],
        staging: Path | None,
        log: Path,
        *,
        token_file: Path | None = None,
        trust_tcp: bool = False,
        insecure_no_auth: bool = False,
        preexec_fn=None,
        upload_delay_s: float = 0.0,
        tier_delay_s: float = 0.0,
        push_delay: tuple[int, float] | None = None,
        no_backpressure: bool = False,
        **env: str,
    ):
        self.no_backpressure = no_backpressure
        self.roots, self.staging, self.log_path = roots, staging, log
        self.upload_delay_s, self.tier_delay_s, self.push_delay = upload_delay_s, tier_delay_s, push_delay
        self.preexec_fn = preexec_fn  # run in the child before exec (e.g. lower its rlimits)
        self.token_file = None if insecure_no_auth else (token_file or default_token_file(log))
        self.trust_tcp = trust_tcp
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def token(self) -> str | None:
        """The bearer token the daemon was started with (None: ``insecure_no_auth``)."""
        return None if self.token_file is None else Path(self.token_file).read_text().strip()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> Path:
        """The daemon's Unix socket: ``CKPTD_SOCKET`` when the test names one, else ``ckptd.sock``
        in its staging folder (or next to its log): never the machine's default socket, which
        the daemons of other tests would share."""
        if "CKPTD_SOCKET" in self.env:
            return Path(self.env["CKPTD_SOCKET"])
        if self.staging is not None:
            return Path(self.staging).absolute() / "ckptd.sock"
        return self.log_path.with_name(f"{self.log_path.stem}-socket") / "ckptd.sock"

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 90.0, port: int | None = None) -> Daemon:
        """Start on ``port`` (a restart on the same address), or on a free one."""
        for _ in range(3):  # the probed port may be taken before the daemon binds it
            self.port = port or launch.free_port()
            args = [sys.executable, "-m", "ckptd.cli.main"]
            if self.upload_delay_s or self.tier_delay_s or self.push_delay or self.no_backpressure:
                args = [sys.executable, "-m", "tests.doubles.slow_serve"]
                args += ["--upload-delay", str(self.upload_delay_s), "--tier-delay", str(self.tier_delay_s)]
                args += ["--no-backpressure"] if self.no_backpressure else []
                if self.push_delay:
                    args += ["--push-delay", "{}:{}".format(*self.push_delay)]
            args += ["serve", "--port", str(self.port)]
            for r in self.roots:
                args += ["--root", r]
            if self.staging is not None:  # None: the daemon's default staging folder
                args += ["--staging-dir", str(self.staging)]
            if self.token_file is not None:
                args += ["--token-file", str(self.token_file)]
                if self.trust_tcp:
                    args += ["--trust-tcp"]
            else:  # insecure_no_auth: only the tests of that mode ask for it
                args += ["--insecure-no-auth"]
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            if self.token_file is None:  # no token at all: not the one the test's trainers read
                env = {k: v for k, v in env.items() if k not in ("CKPTD_TOKEN_FILE", "CKPTD_TOKEN")}
            env.update({"CKPTD_SOCKET": str(self.socket), **self.env})
            with open(self.log_path, "a") as log:
                self.proc = subprocess.Popen(
                    args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), preexec_fn=self.preexec_fn
                )
            deadline = load_deadline(timeout)  # idle start-up: ~2-5 s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self.healthy():
                    return self
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.kill()
                raise AssertionError(f"daemon did not become healthy:\n{self.logs()}")
            if "address already in use" not in self.logs().lower():
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.logs()}")
        raise AssertionError("daemon found no free port")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=scaled(1)) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=scaled(30))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text()[-6000:]
        return ""

    def client(self, timeout: float = 30, token: str | None = "", headers: dict | None = None, **kw):
        """An ``httpx.Client`` on the daemon's socket with its token (``token``: another one; None:
        none): how a trainer on its node calls it (leases and hand-offs need the socket)."""
        import httpx

        token = self.token if token == "" else token
        headers = ({"Authorization": f"Bearer {token}"} if token else {}) | (headers or {})
        transport = httpx.HTTPTransport(uds=self._uds())
        return httpx.Client(base_url="http://ckptd", transport=transport, headers=headers, timeout=timeout, **kw)

    def _uds(self) -> str:
        """The socket's address for a client: its path, or when that is longer than a socket
        address holds, its name under a descriptor of its folder (``daemon_conn.unix_address``),
        kept open while this object lives (a test's tmp path can pass 108 bytes)."""
        path = str(self.socket)
        if len(os.fsencode(path)) < 108:
            return path
        if getattr(self, "_socket_dir", None) is None:
            self._socket_dir = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self._socket_dir}/{os.path.basename(path)}"

    def get(self, path: str, token: str | None = "", tcp: bool = False) -> tuple[int, object]:
        """GET on the daemon's socket, as an operator on its node (``tcp``: its port, a caller
        the kernel does not name) with its token (``token``: another one; None: none)."""
        token = self.token if token == "" else token
        if tcp:
            req = urllib.request.Request(self.url + path)
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(req, timeout=scaled(10)) as r:
                    body = r.read()
                    status = r.status
            except urllib.error.HTTPError as e:
                body, status = e.read(), e.code
        else:
            with self.client(timeout=scaled(10), token=token) as c:
                r = c.get(path)
                body, status = r.content, r.status_code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def metric(self, name: str, token: str | None = "") -> float:
        status, text = self.get("/metrics", token)
        assert status == 200, text
        for line in str(text).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


TOKEN = "harness-token-of-this-test-0123456789abcdef"  # what default_token_file writes


def default_token_file(log: Path) -> Path:
    """The token file of the docs' setup: the one ``CKPTD_TOKEN_FILE`` names (tests/conftest.py
    makes one per test; trainers read it from their environment as the docs' job script sets
    it), else (a benchmark run outside pytest) a new one next to ``log``, 0600."""
    if os.environ.get("CKPTD_TOKEN_FILE"):
        return Path(os.environ["CKPTD_TOKEN_FILE"])
    path = log.with_name(f"{log.stem}-token")
    path.write_text(TOKEN)
    os.chmod(path, 0o600)
    return path


PEER_KEY = "peer-key-of-the-test-ring-0123456789abcdef"  # the daemons' own key: no trainer holds it


def peer_key_file(tmp: Path) -> Path:
    """``tmp/peer-key``: the ring's peer key (``--peer-key-file``), 0600, this user's."""
    path = tmp / "peer-key"
    path.write_text(PEER_KEY)
    os.chmod(path, 0o600)
    return path


def node(
    tmp: Path,
    name: str,
    root: str,
    port: int,
    peers: list[str],
    preexec_fn=None,
    tier_delay_s: float = 0.0,
    trust_tcp: bool = False,
    push_delay: tuple[int, float] | None = None,
    no_backpressure: bool = False,
    **env: str,
) -> Daemon:
    """A started daemon playing node ``name`` of a memory-tier test: its own staging folder and
    log under ``tmp``, the token in ``tmp/token`` (else ``default_token_file``'s), the peer key in ``tmp/peer-key``
    (``peer_key_file``), the ring ``peers`` and its own URL advertised; ``tier_delay_s``,
    ``push_delay``, ``no_backpressure``: test doubles (``Daemon``). As the docs run it: trainers reach it on its
    socket only (``trust_tcp=True`` for the tests of that mode)."""
    d = Daemon(
        [root],
        tmp / f"staging-{name}",
        tmp / f"{name}.log",
        token_file=tmp / "token" if (tmp / "token").exists() else None,
        trust_tcp=trust_tcp,
        preexec_fn=preexec_fn,
        tier_delay_s=tier_delay_s,
        push_delay=push_delay,
        no_backpressure=no_backpressure,
        CKPTD_PEERS=json.dumps(peers),
        CKPTD_ADVERTISE=f"http://127.0.0.1:{port}",
        **({"CKPTD_PEER_KEY_FILE": str(peer_key_file(tmp))} | env),
    )
    return d.start(port=port)


def tier_totals(results: list[dict]) -> dict[str, int]:
    """Chunk bytes per tier (local, peer, root) summed over the ranks' restore results."""
    out = {"local": 0, "peer": 0, "root": 0}
    for r in results:
        for k, v in r["tiers"].items():
            out[k] += v
    return out


def spawn(world: int, scenario: str, args: dict, out: Path, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """``launch.spawn`` with this folder's scenarios (``daemon_scenarios``)."""
    return launch.spawn(world, scenario, args, out, extra_env, scenarios=SCENARIOS)


def run(
    world: int, scenario: str, out: Path, timeout: float = 240, extra_env: dict | None = None, **args
) -> list[dict]:
    return launch.wait(spawn(world, scenario, args, out, extra_env), out, scenario, timeout)


def saves_returned(
    daemons: list[Daemon], root: str, out: Path, world: int = 1, extra_env: dict | None = None
) -> list[subprocess.Popen]:
    """``world`` ranks that save step 1 of ``root`` through ``daemons`` (``save_and_hang``: rank r
    through ``daemons[r % len(daemons)]``), once every rank's save has returned: the hand-off is
    done and the daemons own the snapshots; the ranks hang until the caller kills them
    (``kill_all``). If they fail or time out first, they are killed here."""
    procs = spawn(world, "save_and_hang", {"daemons": [d.socket_url for d in daemons], "root": root}, out, extra_env)
    try:
        wait_for(
            lambda: all((out / f"save_returned_{r}").exists() for r in range(world)),
            "every rank's save to return",
            180,
            procs,
            lambda: launch.logs(out, "save_and_hang", world) + "".join(d.logs() for d in daemons),
        )
    except BaseException:
        kill_all(procs)
        raise
    return procs


def hand_off_body(
    root: str, step: int = 5, attempt: str = "a1", lease: str | None = None, metadata: list | None = None
) -> dict:
    """A hand-off (the body of ``POST /v1/jobs``) of rank 0 of 1: one float32 array ``w`` of 4
    values in one shard, staged as ``w.bin``; ``metadata``: its ``{"key", "file"}`` entries.
    Without ``lease`` the body names none. A test replaces fields with ``hand_off_body(...) | {...}``."""
    body = {"lease": lease} if lease is not None else {}
    body |= {
        "root": root,
        "step": step,
        "attempt": attempt,
        "rank": 0,
        "world_size": 1,
        "shards": [
            {
                "key": "w",
                "layout": {"shape": [4], "dtype": "float32", "shard_shape": [4], "chunk_shape": [4]},
                "coord": [0],
                "file": "w.bin",
            }
        ],
        "metadata": metadata or [],
    }
    return body


def wait_for(pred, what: str, timeout: float = 120.0, procs=(), logs=lambda: "") -> None:
    deadline = load_deadline(timeout)
    while not pred():
        for i, p in enumerate(procs):
            rc = p.poll()
            assert rc is None, f"process {i} (rank {i}) exited with {rc} while waiting for {what}:\n{logs()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{logs()}"
        time.sleep(0.02)


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=scaled(30))
