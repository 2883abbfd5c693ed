"""A real one-node Slurm cluster on loopback, for tests: ``munged``, ``slurmctld`` and ``slurmd``
(Debian's ``slurm-wlm`` and ``munge``) started as subprocesses from a private folder, and stopped
by their pids.

Nothing of the machine's own configuration is used or changed: the key, sockets, spool and
state folders, logs and ``slurm.conf`` live under the given folder, and every client command
gets ``SLURM_CONF`` pointing there (``env()``). The node has ``cpus`` CPUs whatever the machine
has (``SlurmdParameters=config_overrides``): the tests run 4 tasks on 2 cores.

What this sandbox cannot have, and so the configuration leaves out: cgroups (no writable
cgroup hierarchy inside the container: ``proctrack/cgroup`` and ``task/cgroup`` would fail, so
``proctrack/linuxproc`` tracks the job's processes by parent pid and ``task/none`` binds
nothing), accounting (no slurmdbd/MySQL: ``accounting_storage/none``), and more than one node
(one slurmd on one host; several slurmd per host need a build with ``--enable-multiple-slurmd``,
not tried here): an allocation's size changes in ranks per node, not in nodes.

Two partitions: ``low`` (the default) is preempted by jobs of ``high`` the way production
clusters preempt (``preempt/partition_prio``, ``PreemptMode=REQUEUE``, ``GraceTime=150``: SIGTERM to
the job, SIGKILL 150 s later if it has not ended (longer than the recipe's
torchrun --shutdown-timeout, 100 s, as the recipe asks), then the job is requeued).

``python -m tests.systems.slurm DIR`` starts a cluster in DIR and keeps it up until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests import load
from tests.load import scaled

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")


def missing_binaries() -> list[str]:
    return [b for b in SLURM_BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, folder: Path, cpus: int = 8) -> None:
        self.dir = Path(folder)
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket.2"

    # -- configuration ----------------------------------------------------------------------

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o600)
        d = self.dir
        self.conf.write_text(
            f"""\
ClusterName=ckptdtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
InactiveLimit=0
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=low Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=150
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
        )

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for client commands (sbatch, scontrol, ...) and for the daemons."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> SlurmCluster:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm/munge not installed: {', '.join(missing)}")
        self._write_config()
        d = self.dir
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",  # runs as root, in a folder under a world-writable /tmp
                f"--socket={self.munge_socket}",
                f"--key-file={d / 'munge' / 'munge.key'}",
                f"--pid-file={d / 'munge' / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'munge.seed'}",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait(self._controller_up, timeout, "slurmctld")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(self._node_idle, timeout, "the node to be idle")
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(
            args, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = load.deadline(timeout)  # idle: munged < 1 s, slurmctld ~2 s, the node ~5 s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def _controller_up(self) -> bool:
        return self.run(["scontrol", "ping"], check=False, attempts=1).returncode == 0

    def _node_idle(self) -> bool:
        # a line per partition
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, attempts=1).stdout.split()
        return bool(out) and all(s.rstrip("*") in ("idle", "mixed", "allocated") for s in out)

    def _node_idle_only(self) -> bool:
        """No job on the node, none completing."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
        return bool(out) and all(s.rstrip("*") == "idle" for s in out)

    def stop(self) -> None:
        """Cancel every job (their slurmstepd processes outlive slurmd), then SIGTERM to each
        daemon by pid (slurmd first), SIGKILL after 30 s."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--state=PENDING"], check=False)
            self.run(["scancel", "--full", "--state=RUNNING"], check=False)
            deadline = load.deadline(60)
            while time.monotonic() < deadline:
                if not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=scaled(30))

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace")
            out.append(f"--- {f.name}\n{text[-3000:]}")
        return "\n".join(out)

    # -- clients ----------------------------------------------------------------------------

    def run(
        self, args: list[str], check: bool = True, attempts: int = 5, **extra_env: str
    ) -> subprocess.CompletedProcess:
        """A client command (idle: well under 1 s each; 60 s allowed, times ``load.SCALE``).
        Transient failures of a loaded controller are retried (``_transient``); a command that
        may have taken effect although it failed (``sbatch``, ``scontrol requeue``) only when the
        controller was not reached at all. ``attempts=1`` for a probe polled by its caller."""

        def once() -> subprocess.CompletedProcess:
            return subprocess.run(args, env=self.env(**extra_env), capture_output=True, text=True, timeout=scaled(60))

        p = load.retry(once, lambda r: _transient(args, r), " ".join(args[:2]), attempts=attempts)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited with {p.returncode}: {p.stderr.strip()}")
        return p

    def sbatch(self, args: list[str], **extra_env: str) -> int:
        out = self.run(["sbatch", "--parsable", *args], **extra_env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, RestartCnt, NumTasks, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_requeued(self, job_id: int, restarts: int, timeout: float = 240.0, poll: float = 0.5) -> float:
        """Wait until the job is pending again after its ``restarts``-th requeue *and* its previous
        run has left the node (no job on it, none completing); return the wall-clock time at which
        that was seen.

        Why both: changing or starting the job while its old run still completes lets slurmctld
        start the new run and then book the old batch script's exit status against it. The time
        returned bounds the second in which slurmd revoked the old run's credential (the revoke
        comes with the terminate request, before the processes are killed and the node is idle);
        ``start_requeued`` needs it."""
        deadline = load.deadline(timeout)
        while True:
            info = self.job(job_id)
            if info["JobState"] == "PENDING" and int(info["Restarts"]) == restarts and self._node_idle_only():
                return time.time()
            if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                raise RuntimeError(f"job {job_id} ended ({info['JobState']}) instead of requeueing:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not requeued (state {info['JobState']}):\n{self.logs()}")
            time.sleep(poll)

    def start_requeued(self, job_id: int, left_node_at: float, *updates: str) -> None:
        """Start a requeued job now rather than after Slurm's requeue hold, safely.

        After a requeue slurmctld holds the job (``Reason=BeginTime``) for ``cred_expire + 1``
        seconds (121 by default). The hold is what keeps a restart from being refused: slurmd
        records the killed run's credential as revoked with a one-second timestamp and refuses
        any launch whose credential was created in that second or before ("Job N already
        killed, do not launch batch job"; the job then ends FAILED). ``StartTime=now`` right
        after the requeue loses that race whenever the restart falls in the same second. So this
        waits until the clock has left the second of ``left_node_at`` (``wait_requeued``'s
        result, at or after the revoke), less than a second, and only then asks for
        ``StartTime=now``: every credential for the new run is created in a later second than
        the revoke, whatever the scheduler's timing. (An explicit ``StartTime`` one second
        ahead is as safe, but no event wakes the scheduler when that second comes: the job
        waits for its periodic pass, up to a minute.) ``updates`` (e.g. a new size) go in the
        same ``scontrol update``."""
        revoked_second_over = int(left_node_at) + 1
        while (wait := revoked_second_over - time.time()) > 0:  # the condition is the clock itself
            time.sleep(wait)
        self.run(["scontrol", "update", f"JobId={job_id}", *updates, "StartTime=now"])

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = load.deadline(timeout)
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {info.get('JobState')}, not in {states}:\n{self.logs()}")
            time.sleep(0.5)


# What a Slurm client prints when the controller did not answer in time or could not be reached
# (a loaded machine: slurmctld busy, its RPC thread late), and what it prints when the request was
# never delivered. SIGPIPE (-13): the client's connection cut under it.
_NOT_ANSWERED = ("socket timed out", "zero bytes were transmitted", "resource temporarily unavailable", "broken pipe")
_NOT_REACHED = ("unable to contact slurm controller", "connection refused")


def _transient(args: list[str], result: subprocess.CompletedProcess | BaseException) -> bool:
    """Whether ``args`` failed with a passing error of a loaded controller, safe to run again."""
    may_have_acted = args[0] == "sbatch" or args[:2] == ["scontrol", "requeue"]
    if isinstance(result, subprocess.TimeoutExpired):
        return not may_have_acted
    if isinstance(result, BaseException) or result.returncode == 0:
        return False
    text = result.stderr.lower()
    if any(s in text for s in _NOT_REACHED):
        return True
    return not may_have_acted and (result.returncode == -signal.SIGPIPE or any(s in text for s in _NOT_ANSWERED))


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "slurm-cluster").resolve()

    def _stop(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # a background job ignores SIGINT otherwise
        signal.signal(sig, _stop)
    cluster = SlurmCluster(folder)
    try:
        cluster.start()
        print(f"cluster up: export SLURM_CONF={cluster.conf}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
